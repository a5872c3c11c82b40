"""The pipeline (:mod:`.build`): load -> check -> decide -> generate -> write / import.
:mod:`.write` writes files atomically."""
