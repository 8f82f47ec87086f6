"""Control: when and how the composition changes. The ``Decision`` every controller
returns (``decision.py``); the paper's threshold rules (``rules.py``, also home of
``ControllerBase``, which every controller extends, and of ``DecisionSteps``, the
typed three steps of a decision; the rules' options in ``options.py``); the
what-if controller (``whatif.py``) with its candidates, search, guards, replay,
observations (forecast, calibration and audits); and the initial composition.

Imports placement, the cache and the cost terms; never the stack above it
(``tests/test_layout.py``).
"""
