"""Distribution: worker groups driven by one controller program (HybridFlow's model).

``Worker`` and ``@register`` (worker.py) declare how each role method is dispatched;
``WorkerGroup`` (group.py) lets the controller call a role as if it were local;
``placement`` sizes resource pools and maps roles onto them; ``cluster`` builds the
groups on a backend: ``local`` (in-process, the default) or ``ray`` (ray_backend.py).

The role workers (``fuseflow.workers``) import ``worker.py`` alone, the base class and the
decorator their methods carry (as verl's workers import its dispatch decorator); nothing
else in this package is imported from below.

Importing this package is cheap (no torch, no ray); import the submodules for the parts.
"""
