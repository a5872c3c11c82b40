"""Schedule analysis: the fastest causal schedule a spec's algebra admits.

The analysis reads the spec's *algebra* -- is the update affine in the state, is the
increment independent of the state, is the inner model linear in the state, is the loss
quadratic in the model output -- and never the spec's name.  Lets and the inner model
are inlined first, so two specs that differ only in names or in how an expression is
written get the same decision.

Modules:

* the shared analysis -- :mod:`.algebra` (the spec with lets and model inlined, shapes,
  simplification; :class:`NotAdmitted`), :mod:`.polynomial` (degrees, linear forms, linear
  probes, symbolic gradients), :mod:`.ranges` (interval arithmetic: decays provably >= 0),
  :mod:`.recurrence` (the update program as linear recurrences), :mod:`.linear` (values
  linear in the state, structurally), :mod:`.transition` (the normal form
  ``S_t = T_t(S_{t-1}) + W_t``), :mod:`.backprop` (closed-form gradients of the inner loss),
  :mod:`.stabiliser` (exponential input weights and their max stabiliser);
* one module per family, each a plan and its reasons or :class:`NotAdmitted` --
  :mod:`.cache`, :mod:`.additive`, :mod:`.chained`, :mod:`.solve`, :mod:`.delta`, :mod:`.dplr`,
  :mod:`.oja`, :mod:`.momentum`, :mod:`.scan`, :mod:`.minibatch` (with :mod:`.dual`, its dual
  form, and :mod:`.window`, the banded dual form of window losses), :mod:`.online`,
  :mod:`.apply_update`;
* :mod:`.sides` -- the orientation of a matrix state (used on its value side: analysed as its
  transpose);
* :mod:`.decide` -- the ordered table of families :data:`FAMILIES`, :func:`analyse`,
  :func:`explain`.
"""
from .additive import AdditivePlan, AdditiveState
from .algebra import NotAdmitted
from .apply_update import ApplyUpdatePlan
from .cache import CachePlan
from .chained import ChainedPlan
from .decide import FAMILIES, ScheduleDecision, analyse, explain, render_plan
from .delta import DeltaPlan
from .dplr import DplrPlan, DplrStep
from .dual import DualForm, NotDual
from .minibatch import MinibatchPlan
from .momentum import MomentumPlan
from .oja import OjaPlan
from .online import OnlinePlan
from .polynomial import Probe
from .scan import ScanPlan, ScanState
from .solve import SolvePlan
from .window import WindowDual

__all__ = ["FAMILIES", "AdditivePlan", "AdditiveState", "ApplyUpdatePlan", "CachePlan", "ChainedPlan", "DeltaPlan",
           "DplrPlan", "DplrStep", "DualForm", "MinibatchPlan", "MomentumPlan", "NotAdmitted", "NotDual", "OjaPlan",
           "OnlinePlan", "Probe", "ScanPlan", "ScanState", "ScheduleDecision", "SolvePlan", "WindowDual", "analyse",
           "explain", "render_plan"]
