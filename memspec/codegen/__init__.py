"""Code generation: a spec and its schedule decision -> the text of ``compiled/<name>.py``.

* :mod:`.exprs`    -- :class:`ExprEmitter`, one expression AST -> one line of torch;
* :mod:`.context`  -- :class:`Context`, what every emitter of one module reads (the
  decision's plans, names, the runtime pieces the code needs);
* :mod:`.module`   -- the module frame and the ``<Name>Memory`` class; :data:`EMITTERS`,
  one emitter per schedule family (the rows of :data:`memspec.schedule.FAMILIES`):
  :mod:`.online`, :mod:`.minibatch` (with :mod:`.dual`), :mod:`.cache`, :mod:`.additive`
  and :mod:`.delta` (sharing :mod:`.chunked`); :mod:`.program` emits the update program;
* :mod:`.layer`    -- the ``<Name>Layer`` (projections, wiring);
* :mod:`.text`     -- lines, shape comments, names.

Generated modules import only torch and the standard library; the functions they carry
are copied from :mod:`memspec.runtime`.
"""
from .exprs import CodegenError, ExprEmitter
from .module import EMITTERS, generate
from .text import class_name

__all__ = ["EMITTERS", "CodegenError", "ExprEmitter", "class_name", "generate"]
