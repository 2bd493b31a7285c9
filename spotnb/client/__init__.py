"""The notebook side: what runs on the user's machine.

The Python API (``jobs``: ``submit``, ``attach``, ``JobHandle``; ``spotnb`` hands those
out), the refusal of bad arguments (``validation``), what a cell ships (``capture``,
``freevars``), the magics (thin, over the API), following a job (``display``,
``progress``), listing and comparing jobs (``listing``, ``comparison``), the ``spotnb``
command (``cli``) and notebooks run head-less (``notebook``). The widgets
(``spotnb.widgets``) and records (``spotnb.records``) are the notebook side too. Nothing
on the instance imports this package.
"""
