"""Renderers that ship with the core."""
