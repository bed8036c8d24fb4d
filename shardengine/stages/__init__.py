"""The engine: one class whose stage is data.

``engine.StageEngine`` holds one rank's state of a sharded model;
``recipes.STAGES`` says, per stage, what is sharded (``spec.StageSpec``) and which
collaborators do what differs: how a bucket's gradient is stored and reduced
(``gradients``), where parameters live between uses (``buckets`` at stages 0-2,
``units`` at stage 3), how updated parameters reach every rank (``publication``).
The collaborators every stage shares are ``forward``, ``backward``, ``window``,
``stepping``, ``failure`` and ``reports``; ``replan`` grows the plan.
"""
