"""Schedule analysis: the fastest causal schedule a spec's algebra admits.

The analysis reads the spec's *algebra* -- is the update affine in the state, is the
increment independent of the state, is the inner model linear in the state, is the loss
quadratic in the model output -- and never the spec's name.  Lets and the inner model
are inlined first, so two specs that differ only in names or in how an expression is
written get the same decision.

Modules:

* :mod:`.algebra`     the spec with lets and model inlined, shapes, simplification,
                      the update program's normal forms (:class:`NotAdmitted`);
* :mod:`.polynomial`  degrees, linear forms, linear probes, symbolic gradients;
* :mod:`.ranges`      interval arithmetic (decays provably >= 0);
* :mod:`.recurrence`  the update program as linear recurrences (mini-batch, dual form);
* one module per family -- :mod:`.cache`, :mod:`.additive`, :mod:`.delta`, :mod:`.scan`,
  :mod:`.minibatch` (with :mod:`.dual`, its dual form), :mod:`.online`;
* :mod:`.decide`      the ordered table of families, :func:`analyse`, :func:`explain`.
"""
from .additive import AdditivePlan, AdditiveState
from .algebra import NotAdmitted
from .cache import CachePlan
from .decide import FAMILIES, ScheduleDecision, analyse, explain, render_plan
from .delta import DeltaPlan
from .dual import DualForm, NotDual
from .minibatch import MinibatchPlan
from .online import OnlinePlan
from .polynomial import Probe
from .scan import ScanPlan, ScanState

__all__ = ["FAMILIES", "AdditivePlan", "AdditiveState", "CachePlan", "DeltaPlan", "DualForm", "MinibatchPlan",
           "NotAdmitted", "NotDual", "OnlinePlan", "Probe", "ScanPlan", "ScanState", "ScheduleDecision", "analyse",
           "explain", "render_plan"]
