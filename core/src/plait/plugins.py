"""Plugin discovery and the registry of named components.

Plugins come from three places, loaded in this order:

1. the core's own plugin modules (`BUILTIN_PLUGINS`), registered like any other plugin;
2. modules named in `PLAIT_PLUGIN_MODULES` (comma-separated; handy for one-off local plugins);
3. the `plait` entry-point group of installed distributions.

Environment variables for hermetic runs:

- `PLAIT_PLUGINS=a,b` loads only the entry-point plugins named a and b (`none` loads none);
- `PLAIT_BLOCK_PLUGINS=a,b` skips those entry-point plugins.

A hookimpl whose name matches no hook spec fails at start-up, naming the plugin.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import tomllib
from collections.abc import Iterator, Mapping
from importlib import resources
from typing import Any, Generic, TypeVar

import attrs
import click
import pluggy
import structlog

from plait import hookspecs
from plait.errors import PluginError, UnknownComponentError, did_you_mean
from plait.kinds import KINDS, KINDS_BY_NAME, Kind, Register
from plait.logs import ensure_configured
from plait.schema import structure_options
from plait.targets import load_target

F = TypeVar("F")

log = structlog.get_logger("plait.plugins")

ENTRY_POINT_GROUP = "plait"
BUILTIN_PLUGINS = ("plait.builtins",)


@attrs.frozen
class Factory(Generic[F]):
    """One registered component: its name, where it lives, and who registered it."""

    kind: Kind[F]
    name: str
    target: F | str
    """The factory, or a lazy "module:attribute" string naming it."""
    options: type | str | None = None
    """An attrs class, a lazy "module:Class" string, or None (the component takes no options)."""
    description: str = ""
    plugin: str = ""

    def load(self) -> F:
        """The factory itself, importing its module on first use."""
        if not isinstance(self.target, str):
            return self.target
        try:
            return load_target(self.target)
        except ImportError as exc:
            raise PluginError(
                f"{self.kind.label} {self.name!r} (from plugin {self.plugin!r}) failed to import "
                f"{self.target!r}: {exc}",
                fix="install the plugin's dependencies "
                "(pip install the distribution that provides it)",
            ) from exc

    def options_class(self) -> type | None:
        return load_target(self.options) if isinstance(self.options, str) else self.options

    def validate_options(self, data: Mapping[str, Any] | None, path: str) -> Any:
        """`data` as the component's options object (errors name `path`)."""
        return structure_options(self.options_class(), data or {}, path)


@attrs.frozen
class PluginInfo:
    name: str
    distribution: str
    version: str
    module: str


def _kind(kind: Kind[F] | str) -> Kind[F]:
    if isinstance(kind, Kind):
        return kind
    try:
        return KINDS_BY_NAME[kind]
    except KeyError:
        raise PluginError(
            f"no component kind {kind!r}{did_you_mean(kind, KINDS_BY_NAME)}",
            fix=f"use one of {', '.join(KINDS_BY_NAME)}",
        ) from None


class Registry:
    """Named components by kind, filled by the plugins' register hooks."""

    def __init__(self) -> None:
        self._factories: dict[str, dict[str, Factory[Any]]] = {kind.name: {} for kind in KINDS}

    def add(self, factory: Factory[Any]) -> None:
        existing = self._factories[factory.kind.name].get(factory.name)
        if existing is not None and existing.plugin != factory.plugin:
            raise PluginError(
                f"{factory.kind.label} {factory.name!r} is registered by both plugin "
                f"{existing.plugin!r} and plugin {factory.plugin!r}",
                fix="uninstall one of them, or block one with "
                f"PLAIT_BLOCK_PLUGINS={factory.plugin}",
            )
        self._factories[factory.kind.name][factory.name] = factory

    def names(self, kind: Kind[Any] | str) -> list[str]:
        return sorted(self._factories[_kind(kind).name])

    def all(self, kind: Kind[F] | str) -> list[Factory[F]]:
        factories = self._factories[_kind(kind).name]
        return [factories[n] for n in sorted(factories)]

    def get(self, kind: Kind[F] | str, name: str) -> Factory[F]:
        known = _kind(kind)
        try:
            return self._factories[known.name][name]
        except KeyError:
            raise UnknownComponentError(
                f"unknown {known.label} {name!r}{did_you_mean(name, self.names(known))}; "
                f"registered: {', '.join(self.names(known)) or '(none)'}",
                fix=install_hint(known, name),
            ) from None


def install_hint(kind: Kind[Any], name: str) -> str:
    """What to install for `name`, from the catalogue of first-party distributions."""
    catalogue = tomllib.loads(resources.files("plait").joinpath("catalogue.toml").read_text())
    for distribution, provides in catalogue.items():
        for provided in provides.get(kind.name, ()):
            if name == provided or (provided.endswith(".") and name.startswith(provided)):
                return (
                    f"pip install {distribution} (it provides {kind.label} {name!r}); "
                    "`plait plugins` lists what is installed"
                )
    return "check the spelling; `plait plugins` lists every installed plugin and what it registers"


def _env_list(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {item.strip() for item in raw.split(",") if item.strip() and item.strip() != "none"}


class PluginManager:
    """pluggy's manager plus plait's registry and plugin metadata."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.registry = Registry()

    def load(self) -> PluginManager:
        core_version = importlib.metadata.version("plait")
        for module_name in BUILTIN_PLUGINS:
            self._register(module_name, importlib.import_module(module_name), "plait", core_version)
        for module_name in sorted(_env_list("PLAIT_PLUGIN_MODULES") or ()):
            try:
                module = importlib.import_module(module_name)
            except ImportError as exc:
                raise PluginError(
                    f"PLAIT_PLUGIN_MODULES names {module_name!r}, which does not import: {exc}",
                    fix="fix the module name or unset PLAIT_PLUGIN_MODULES",
                ) from exc
            self._register(module_name, module, "(local)", "-")
        self._load_entry_points()
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(
                f"plugin {self.pm.get_name(exc.plugin)!r} implements a hook plait does not "
                f"define: {exc}",
                fix="rename the hookimpl to one of the specs in plait.hookspecs, or upgrade plait",
            ) from exc
        self._fill_registry()
        return self

    def _load_entry_points(self) -> None:
        allowed = _env_list("PLAIT_PLUGINS")
        blocked = _env_list("PLAIT_BLOCK_PLUGINS") or set()
        for ep in sorted(
            importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name
        ):
            if ep.name in blocked or (allowed is not None and ep.name not in allowed):
                log.debug("plugin skipped", plugin=ep.name)
                continue
            if ep.name in self.plugins:
                continue  # the same distribution seen twice on sys.path
            try:
                module = ep.load()
            except Exception as exc:  # a broken plugin must name itself, whatever it raised
                raise PluginError(
                    f"plugin {ep.name!r} ({ep.value}) failed to load: {type(exc).__name__}: {exc}",
                    fix=f"reinstall it, or skip it with PLAIT_BLOCK_PLUGINS={ep.name}",
                ) from exc
            dist = ep.dist.name if ep.dist else "?"
            version = ep.dist.version if ep.dist else "?"
            self._register(ep.name, module, dist, version)

    def _register(self, name: str, module: Any, distribution: str, version: str) -> None:
        try:
            self.pm.register(module, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(
                f"plugin {name!r} has an invalid hookimpl: {exc}",
                fix="check the hookimpl's argument names against plait.hookspecs",
            ) from exc
        self.plugins[name] = PluginInfo(
            name, distribution, version, getattr(module, "__name__", str(module))
        )

    def _fill_registry(self) -> None:
        for kind in KINDS:
            for impl in getattr(self.pm.hook, kind.hook).get_hookimpls():
                impl.function(
                    **{
                        arg: self._register_callback(kind, impl.plugin_name)
                        for arg in impl.argnames
                    }
                )

    def _register_callback(self, kind: Kind[F], plugin: str) -> Register[F]:
        def register(
            name: str, target: F | str, *, options: type | str | None = None, description: str = ""
        ) -> None:
            self.registry.add(Factory(kind, name, target, options, description, plugin))
            log.debug("registered", kind=kind.name, name=name, plugin=plugin)

        return register

    def registrations(self, plugin: str) -> Iterator[Factory[Any]]:
        for kind in KINDS:
            for factory in self.registry.all(kind):
                if factory.plugin == plugin:
                    yield factory

    def add_commands(self, cli: click.Group) -> None:
        self.pm.hook.plait_register_commands(cli=cli)


@functools.cache
def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, loaded on first use."""
    ensure_configured()
    return PluginManager().load()


def get_registry() -> Registry:
    return get_plugin_manager().registry


def build(
    kind: Kind[Any] | str,
    name: str,
    *args: Any,
    options: Mapping[str, Any] | None = None,
    options_path: str = "",
    **kwargs: Any,
) -> Any:
    """Look up `name`, validate `options` against its options class, and call its factory."""
    factory = get_registry().get(kind, name)
    validated = factory.validate_options(options, options_path or f"{factory.kind.name}.options")
    return factory.load()(*args, options=validated, **kwargs)
