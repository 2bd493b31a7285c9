"""The agent that runs on the instance (``python -m spotnb.kernel_remote``).

It reads the job's spec from the store, takes the lease, runs the cell in an IPython
kernel, relays its outputs as events and watches for spot interruption notices. See
:mod:`spotnb.kernel_remote.agent`.
"""
