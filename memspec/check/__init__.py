"""The checks of a spec before anything is generated from it.

* :mod:`.verify`       -- :func:`~.verify.check`: lower the spec and run every check, in order;
  the table of diagnostic codes;
* :mod:`.graph`        -- the dataflow graph of one token step (every expression typed);
* :mod:`.context`      -- what the checks share: the spec, its graph, the diagnostics;
* :mod:`.declarations` -- safe identifiers, names declared once, dims that exist;
* :mod:`.order`        -- what each formula may use at its place in a step; no cycles;
* :mod:`.statements`   -- temporaries, update targets, caches, ``grad``, block updates;
* :mod:`.usage`        -- states written and read, nothing unused, sizes, ``log`` of states;
* :mod:`.complexity`, :mod:`.sizes` -- the limits of inlined expressions and of tensor sizes.
"""
