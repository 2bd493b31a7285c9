"""Which calls draw from a global random number generator.

The checkpoint holds the global RNG states (Python's ``random``, NumPy's legacy global
state, torch's CPU and CUDA generators) as they are at the save. A draw the resumed run
does not make again, or makes from another state, changes every draw after it:
:mod:`spotnb.client.carried` uses :func:`global_draw` to find them. A call with a
``generator=`` of its own draws from that generator, not the global one.
"""

from __future__ import annotations

import ast

__all__ = ["global_draw", "shuffled_argument"]

# The functions of `random` that use its hidden global instance.
_RANDOM = frozenset({
    "random", "uniform", "triangular", "randint", "choice", "randrange", "sample",
    "shuffle", "choices", "normalvariate", "lognormvariate", "expovariate",
    "vonmisesvariate", "gammavariate", "gauss", "betavariate", "paretovariate",
    "weibullvariate", "getrandbits", "randbytes", "binomialvariate", "seed", "setstate"})
# numpy.random's names that are not its legacy global state.
_NUMPY_OWN_STATE = frozenset({
    "default_rng", "Generator", "RandomState", "SeedSequence", "BitGenerator", "PCG64",
    "PCG64DXSM", "MT19937", "Philox", "SFC64", "get_state", "get_bit_generator"})
_TORCH = frozenset({
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
    "normal", "bernoulli", "multinomial", "poisson", "dropout", "manual_seed", "seed",
    "set_rng_state", "feature_dropout", "alpha_dropout"})
_TORCH_MODULES = ("torch.nn.functional.", "torch.nn.init.", "torch.cuda.", "torch.random.")
_TORCH_NOT_DRAWS = frozenset({"calculate_gain", "zeros_", "ones_", "constant_", "eye_",
                              "dirac_", "get_rng_state", "initial_seed", "is_available",
                              "device_count", "synchronize", "get_rng_state_all",
                              "current_device", "set_device", "empty_cache", "fork_rng"})
# In-place draws of a tensor: x.uniform_(), x.normal_(), ...
_TENSOR_DRAWS = frozenset({"random_", "uniform_", "normal_", "bernoulli_", "exponential_",
                           "geometric_", "cauchy_", "log_normal_"})
# Functions that shuffle their first argument in place.
_SHUFFLES = frozenset({"random.shuffle", "numpy.random.shuffle"})


def global_draw(dotted: str | None, call: ast.Call) -> str | None:
    """The name of the global-RNG function ``call`` calls (``torch.randint``), or None.

    ``dotted``: the called function's full name (``torch.randint``), None when it is no
    module's function (a method of an object: ``x.normal_()`` is still a draw).
    """
    if any(k.arg == "generator" for k in call.keywords):
        return None
    if dotted is None:
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr in _TENSOR_DRAWS:
            return f".{func.attr}()"
        return None
    module, _, name = dotted.rpartition(".")
    if module == "random" and name in _RANDOM:
        return dotted
    if module == "numpy.random" and name not in _NUMPY_OWN_STATE:
        return dotted.replace("numpy.", "np.", 1)
    if module == "torch" and name in _TORCH:
        return dotted
    if any(dotted.startswith(prefix) for prefix in _TORCH_MODULES) and \
            name not in _TORCH_NOT_DRAWS and ("dropout" in name or name.endswith("_")
                                              or "seed" in name):
        return dotted
    return None


def shuffled_argument(dotted: str | None, call: ast.Call) -> ast.expr | None:
    """What ``call`` shuffles in place: the argument of ``random.shuffle(x)``,
    ``np.random.shuffle(x)`` or ``rng.shuffle(x)`` (a generator's method); else None."""
    func = call.func
    shuffles = dotted in _SHUFFLES or (
        dotted is None and isinstance(func, ast.Attribute) and func.attr == "shuffle")
    return call.args[0] if shuffles and call.args else None
