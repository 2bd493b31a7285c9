"""The instance runtime: what runs inside the training cell's kernel.

``runtime`` is the API a cell uses (``from spotnb import runtime as spot``: ``spot.log``,
``spot.Checkpoint``, ``spot.sync_dir``...), a facade over the parts: ``process`` and
``session`` (its process's link to the agent), ``checkpoint`` (what a checkpoint holds,
and its restore), ``saving`` (when it saves, and one save's states), ``upload`` (a save's
background write), ``distributed`` (the world a worker runs in), ``bootstrap`` (the
agent's hooks around the cell); ``syncdir`` directories kept in the store; ``tb``
TensorBoard on a synced directory; ``looptotal`` a loop's length, guessed; ``cellvars``
and ``loaders`` (entries that follow a variable, data loaders that resume);
``integrations/`` the framework callbacks (``spot.callbacks``). Imports nothing of the
notebook side.
"""
