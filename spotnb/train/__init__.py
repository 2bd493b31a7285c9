"""The instance runtime: what runs inside the training cell's kernel.

``runtime`` is the API a cell uses (``from spotnb import runtime as spot``: ``spot.log``,
``spot.Checkpoint``, ``spot.sync_dir``...); ``session`` its process's link to the agent;
``syncdir`` directories kept in the store; ``tb`` TensorBoard on a synced directory;
``looptotal`` a loop's length, guessed; ``integrations/`` the framework callbacks
(``spot.callbacks``). Imports nothing of the notebook side.
"""
