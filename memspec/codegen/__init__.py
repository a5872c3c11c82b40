"""Code generation: a spec and its schedule decision -> the text of ``compiled/<name>.py``.

* :mod:`.module`     -- the module frame and the ``<Name>Memory`` class; :data:`EMITTERS`,
  one :class:`Emitter` per schedule family (the rows of :data:`memspec.schedule.FAMILIES`),
  each declared by its emitter module (``EMITTER``), from which the frame derives its tables;
  :func:`register` adds one (with :func:`memspec.schedule.decide.register` for its row);
* the emitters -- :mod:`.cache`, :mod:`.additive`, :mod:`.delta`, :mod:`.dplr`, :mod:`.oja`,
  :mod:`.momentum`, :mod:`.scan`, :mod:`.chained` and :mod:`.solve` (the exact chunked ones sharing
  :mod:`.chunked`),
  :mod:`.minibatch` (with :mod:`.dual`, its dual form -- the chunk algebra in :mod:`.dualchunk`
  on the term objects of :mod:`.dualterms` --, :mod:`.prestep`, the state-independent part of a
  chunk step, and :mod:`.window`, window losses), :mod:`.online`, :mod:`.apply_update`;
* :mod:`.context`    -- :class:`Context`, what every emitter of one module reads (the
  decision's plans, names, the runtime pieces the code needs), and :class:`Emitter`;
* :mod:`.exprs`      -- :class:`ExprEmitter`, one expression AST -> one line of torch;
* :mod:`.program`    -- the update program as emitted statements;
* :mod:`.layer`      -- the ``<Name>Layer`` (projections, wiring);
* :mod:`.calls`      -- kernel calls as structure until the module is written (the constants
  every call passes bound, each call written without them);
* :mod:`.specialise` -- runtime functions specialised to the arguments a module passes;
* :mod:`.layout`     -- lines within 100 columns, checked against the AST;
* :mod:`.text`       -- lines, shape comments, names, the one escaping path of spec text.

Generated modules import only torch and the standard library; the functions they carry
are copied from :mod:`memspec.runtime`.
"""
from .exprs import CodegenError, ExprEmitter
from .context import Emitter
from .module import EMITTERS, generate, register
from .text import class_name

__all__ = ["EMITTERS", "CodegenError", "Emitter", "ExprEmitter", "class_name", "generate", "register"]
