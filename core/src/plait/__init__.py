"""plait: a plugin-based framework for reinforcement learning of language models.

The core defines the contracts (hook specs in `plait.hookspecs`, protocols in `plait.protocols`,
types in `plait.types`) and the controller that composes plugins. It imports without torch.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("plait")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"
