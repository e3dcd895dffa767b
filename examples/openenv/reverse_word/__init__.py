"""The reverse-word OpenEnv environment."""

from .client import ReverseWordEnv
from .models import ReverseWordAction, ReverseWordObservation

__all__ = ["ReverseWordAction", "ReverseWordEnv", "ReverseWordObservation"]
