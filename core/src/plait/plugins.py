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
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import pluggy
import structlog

from plait import hookspecs
from plait.errors import PluginError, UnknownComponentError, did_you_mean

log = structlog.get_logger("plait.plugins")

ENTRY_POINT_GROUP = "plait"
BUILTIN_PLUGINS = ("plait.builtins",)

# Component kinds and the hook that registers each.
KIND_HOOKS: dict[str, str] = {
    "trainer_engine": "plait_register_trainer_engines",
    "inference_engine": "plait_register_inference_engines",
    "weight_sync": "plait_register_weight_syncs",
    "renderer": "plait_register_renderers",
    "env": "plait_register_envs",
    "loss": "plait_register_losses",
    "metric_sink": "plait_register_metric_sinks",
    "model": "plait_register_models",
}

# Where well-known names live, so that an unknown name can say what to install.
KNOWN_PROVIDERS: dict[str, dict[str, str]] = {
    "trainer_engine": {"torch": "plait-torch", "fsdp2": "plait-fsdp2", "megatron": "plait-megatron"},
    "inference_engine": {"torch": "plait-torch", "vllm": "plait-vllm", "sglang": "plait-sglang"},
    "renderer": {"qwen3": "plait-qwen", "qwen3_keep_reasoning": "plait-qwen", "qwen3_instruct_2507": "plait-qwen",
                 "qwen3_5": "plait-qwen", "qwen3_5_keep_reasoning": "plait-qwen"},
    "env": {"math.": "plait-math", "docker.": "plait-docker", "code.": "plait-docker"},
    "model": {"smollm2-135m-instruct": "plait-torch", "tiny-qwen3": "plait-torch", "tiny-qwen3-arith": "plait-torch"},
}


def load_target(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    obj: Any = module
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


@attrs.frozen
class Factory:
    """One registered component: its name, where it lives, and who registered it."""

    kind: str
    name: str
    target: Any  # a callable/object, or a lazy "module:attribute" string
    options: Any = None  # an attrs class, a lazy "module:Class" string, or None (no options)
    description: str = ""
    plugin: str = ""

    def load(self) -> Any:
        """The factory itself, importing its module on first use."""
        if not isinstance(self.target, str):
            return self.target
        try:
            return load_target(self.target)
        except ImportError as exc:
            raise PluginError(
                f"{self.kind} {self.name!r} (from plugin {self.plugin!r}) failed to import "
                f"{self.target!r}: {exc}",
                fix="install the plugin's dependencies (pip install the distribution that provides it)",
            ) from exc

    def options_class(self) -> type | None:
        if isinstance(self.options, str):
            return load_target(self.options)
        return self.options


@attrs.frozen
class PluginInfo:
    name: str
    distribution: str
    version: str
    module: str


class Registry:
    """Named components by kind, filled by the plugins' register hooks."""

    def __init__(self) -> None:
        self._factories: dict[str, dict[str, Factory]] = {kind: {} for kind in KIND_HOOKS}

    def add(self, factory: Factory) -> None:
        existing = self._factories[factory.kind].get(factory.name)
        if existing is not None and existing.plugin != factory.plugin:
            raise PluginError(
                f"{factory.kind} {factory.name!r} is registered by both plugin {existing.plugin!r} "
                f"and plugin {factory.plugin!r}",
                fix=f"uninstall one of them, or block one with PLAIT_BLOCK_PLUGINS={factory.plugin}",
            )
        self._factories[factory.kind][factory.name] = factory

    def names(self, kind: str) -> list[str]:
        return sorted(self._factories[kind])

    def all(self, kind: str) -> list[Factory]:
        return [self._factories[kind][n] for n in self.names(kind)]

    def get(self, kind: str, name: str) -> Factory:
        try:
            return self._factories[kind][name]
        except KeyError:
            raise UnknownComponentError(
                f"unknown {kind.replace('_', ' ')} {name!r}{did_you_mean(name, self.names(kind))}; "
                f"registered: {', '.join(self.names(kind)) or '(none)'}",
                fix=_install_hint(kind, name),
            ) from None


def _install_hint(kind: str, name: str) -> str:
    for prefix, distribution in KNOWN_PROVIDERS.get(kind, {}).items():
        if name == prefix or (prefix.endswith(".") and name.startswith(prefix)):
            return f"pip install {distribution} (it provides {kind.replace('_', ' ')} {name!r}); `plait plugins` lists what is installed"
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
                f"plugin {self.pm.get_name(exc.plugin)!r} implements a hook plait does not define: {exc}",
                fix="rename the hookimpl to one of the specs in plait.hookspecs, or upgrade plait",
            ) from exc
        self._fill_registry()
        return self

    def _load_entry_points(self) -> None:
        allowed = _env_list("PLAIT_PLUGINS")
        blocked = _env_list("PLAIT_BLOCK_PLUGINS") or set()
        for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
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
        self.plugins[name] = PluginInfo(name, distribution, version, getattr(module, "__name__", str(module)))

    def _fill_registry(self) -> None:
        for kind, hook_name in KIND_HOOKS.items():
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                impl.function(**{arg: self._register_callback(kind, impl.plugin_name) for arg in impl.argnames})

    def _register_callback(self, kind: str, plugin: str) -> Callable[..., None]:
        def register(name: str, target: Any, *, options: Any = None, description: str = "") -> None:
            self.registry.add(Factory(kind, name, target, options, description, plugin))
            log.debug("registered", kind=kind, name=name, plugin=plugin)

        return register

    def registrations(self, plugin: str) -> Iterator[Factory]:
        for kind in KIND_HOOKS:
            for factory in self.registry.all(kind):
                if factory.plugin == plugin:
                    yield factory

    def add_commands(self, cli: Any) -> None:
        self.pm.hook.plait_register_commands(cli=cli)


@functools.cache
def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, loaded on first use."""
    from plait.logs import ensure_configured

    ensure_configured()
    return PluginManager().load()


def get_registry() -> Registry:
    return get_plugin_manager().registry


def build(kind: str, name: str, *args: Any, options: Mapping[str, Any] | None = None,
          options_path: str = "", **kwargs: Any) -> Any:
    """Look up `name`, validate `options` against its options class, and call its factory."""
    from plait.config import structure_options

    factory = get_registry().get(kind, name)
    validated = structure_options(factory.options_class(), options or {}, options_path or f"{kind}.options")
    return factory.load()(*args, options=validated, **kwargs)
