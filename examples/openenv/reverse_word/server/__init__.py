"""The reverse-word environment's server side."""

from .reverse_word_environment import ReverseWordEnvironment

__all__ = ["ReverseWordEnvironment"]
