"""Where the nodes read and write, and how they talk to the host: ComfyUI when present, else local.

Inside ComfyUI, folders come from ``folder_paths`` (input, ``models/diffusers``, the single-file
model folders ``diffusion_models`` (which covers ``models/unet``) and ``checkpoints``, ``models/loras``,
output), progress goes through ``comfy.utils.ProgressBar`` (in ComfyUI 0.3.64 its hook updates the
V3 progress state and sends the ``progress`` event; the V3 API's ``execution.set_progress`` of
``comfy_api.v0_0_2`` updates the state only, with no ``progress`` event and no interrupt check), interruption is
``comfy.model_management.processing_interrupted`` and events go to the page through
``PromptServer.instance.send_sync``. Without ComfyUI (``segckpt run``) the same layout lives under
a base folder (``SEGCKPT_BASE_DIR`` or the current directory); progress shows as the trainer's log lines.

Every user-given name is resolved with :func:`contained`, which refuses absolute paths, ``..``
and links that lead outside the allowed root: a ComfyUI server may be reachable by others.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

BUILTIN_DATA = "(built-in sample photos)"
BUILTIN_CLIP = "(built-in sample clip)"
"""The Dataset node's built-in folders: scikit-image's photographs, and a 33-frame pan across one (video families)."""
TINY_PRESET = "(tiny preset)"
MODEL_FILE_FOLDERS = ("diffusion_models", "checkpoints")
"""ComfyUI's folder kinds of single model files (``diffusion_models`` includes ``models/unet``)."""
MODEL_FILE_SUFFIXES = {"diffusion_models": (".safetensors", ".gguf"), "checkpoints": (".safetensors",)}
"""File names listed per folder kind: a GGUF file holds a transformer alone (city96/ComfyUI-GGUF puts them
in ``models/unet`` or ``models/diffusion_models``), never a full checkpoint. Filtered here, not by
``folder_paths``' extension sets (ComfyUI's ``supported_pt_extensions`` holds no ``.gguf``)."""
GGUF_FOLDER = "unet_gguf"
"""The folder kind ComfyUI-GGUF registers (``models/unet`` and ``models/diffusion_models``, and what an
``extra_model_paths.yaml`` adds to it): its folders are listed as ``diffusion_models/``."""


class PathError(ValueError):
    """A user-given path is not inside the folder it must stay in."""


def contained(root: str | Path, name: str, key: str) -> Path:
    """``root / name``, refusing anything that leaves ``root``.

    Raises:
        PathError: ``name`` is absolute, contains ``..``, or resolves (through links) outside
            ``root``; the message names the input ``key`` and the value.
    """
    if not isinstance(name, str) or not name.strip():
        raise PathError(f"{key}={_shown(name)} is invalid: allowed a non-empty name inside {root}")
    parts = Path(name).parts
    if "\x00" in name or any(len(part.encode("utf-8", "surrogatepass")) > 255 for part in parts):
        raise PathError(f"{key}={_shown(name)} is invalid: allowed folder and file names of at most 255 bytes, "
                        "without NUL characters")
    if Path(name).is_absolute() or ".." in parts or name.startswith("~"):
        raise PathError(f"{key}={_shown(name)} is invalid: allowed a relative name inside {root}, "
                        "without '..' or an absolute path")
    base = Path(root).resolve()
    try:
        path = (base / name).resolve()
    except (OSError, ValueError) as exc:  # too many links, a name the file system refuses
        raise PathError(f"{key}={_shown(name)} is invalid: {exc}") from exc
    if path != base and base not in path.parents:
        raise PathError(f"{key}={_shown(name)} is invalid: it leads outside {root} (through a link)")
    return path


def _shown(value: object, limit: int = 80) -> str:
    """``repr(value)``, shortened for a one-line message."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 5]}...{text[-2:]}"


@dataclass
class Host:
    """The host's folders and services.

    Attributes:
        input_dir: datasets live under it. diffusers_dirs: model folders live under them.
        loras_dir: LoRA files are written there. output_dir: training runs are written there.
        progress: ``progress(node_id, total) -> update(value, total=None)`` (a new ``total``
            replaces the bar's: a node's phases count their own work).
        interrupted: polled between optimizer steps.
        send: ``send(event, data)`` to the page (no-op without ComfyUI).
        model_file_dirs: single ``.safetensors`` model files live under them, by the prefix they
            are shown with (``{"diffusion_models": [...], "checkpoints": [...]}``).
    """

    input_dir: Path
    diffusers_dirs: list[Path]
    loras_dir: Path
    output_dir: Path
    progress: Callable[[Any, int], Callable[..., None]]
    interrupted: Callable[[], bool]
    send: Callable[[str, dict], None]
    model_file_dirs: dict[str, list[Path]] = field(default_factory=dict)
    raise_interrupt: Callable[[], None] = lambda: None
    """Raise the host's own "interrupted" exception (ComfyUI: the prompt ends as interrupted)."""
    base_dir: Path | None = None
    """The host's base folder (ComfyUI's), hidden from messages too."""
    release_models: Callable[[], list[str]] = lambda: []
    """Before a training run: ask the host to unload its own models and free its cached device memory;
    log lines saying what it unloaded (ComfyUI: :func:`release_comfyui_models`; locally: nothing)."""

    def __post_init__(self) -> None:
        # one folder reached twice (ComfyUI-GGUF's kind repeats diffusion_models' folders; a
        # models/unet linked to models/diffusion_models) is searched and named once
        self.diffusers_dirs = _unique(self.diffusers_dirs)
        self.model_file_dirs = {kind: _unique(dirs) for kind, dirs in self.model_file_dirs.items()}

    def folder_name(self, folder: Path) -> str:
        """How messages name one of the host's model folders: its path under the base folder
        (``models/unet``; ``output/diffusion_models``, which ComfyUI searches too), else
        ``models/<its name>`` (a folder of ``extra_model_paths.yaml``)."""
        if self.base_dir is not None:
            for inner, base in ((Path(folder).absolute(), Path(self.base_dir).absolute()),
                                (Path(folder).resolve(), Path(self.base_dir).resolve())):
                if inner != base and inner.is_relative_to(base):
                    return inner.relative_to(base).as_posix()
        return f"models/{Path(folder).name}"

    def folder_list(self, folders: list[Path]) -> str:
        """``folders`` as a message lists them: by their public names, each name once."""
        return ", ".join(dict.fromkeys(self.public(str(folder)) for folder in folders))

    def public(self, text: str) -> str:
        """``text`` with the host's absolute folders replaced by their ComfyUI names (``output/...``,
        ``input/...``, ``models/loras/...``): messages reach the browser, and a shared server must
        not reveal its layout."""
        roots = [(self.output_dir, "output"), (self.input_dir, "input"), (self.loras_dir, "models/loras")]
        roots += [(d, "models/diffusers") for d in self.diffusers_dirs]
        roots += [(d, self.folder_name(d)) for dirs in self.model_file_dirs.values() for d in dirs]
        if self.base_dir is not None:
            roots.append((self.base_dir, "<comfyui>"))
        # where else the engine's messages may point: its temporary run folders, Python, the pack
        roots += [(Path(tempfile.gettempdir()), "<tmp>"), (Path(sys.prefix), "<python>"),
                  (Path(sys.base_prefix), "<python>"), (Path(__file__).resolve().parents[1], "<pack>")]
        for root, name in sorted(roots, key=lambda r: -len(str(Path(r[0]).resolve()))):
            # absolute forms only: a relative root ("." for the current folder) would match any text
            for form in {str(root), str(Path(root).resolve())} - {""}:
                if Path(form).is_absolute():
                    text = text.replace(form, name)
        return text


def _unique(folders: list[Path]) -> list[Path]:
    """``folders`` in order, each folder once: later entries that resolve (through links) to an
    earlier one are left out."""
    kept: dict[Path, Path] = {}
    for folder in map(Path, folders):
        kept.setdefault(folder.resolve(), folder)
    return list(kept.values())


def in_comfyui() -> bool:
    """Whether ComfyUI's modules are importable (the pack runs inside a ComfyUI process)."""
    return importlib.util.find_spec("folder_paths") is not None and importlib.util.find_spec("comfy") is not None


def current_host() -> Host:
    """The :class:`Host` of this process (built on each call: nothing is cached between runs)."""
    if in_comfyui():
        return _comfyui_host()
    return local_host(Path(os.environ.get("SEGCKPT_BASE_DIR", ".")))


def local_host(base: Path) -> Host:
    """A ComfyUI-like layout under ``base`` (``input/``, ``models/diffusers``,
    ``models/unet`` + ``models/diffusion_models`` (shown as ``diffusion_models/``, as ComfyUI lists
    them together), ``models/checkpoints``, ``models/loras``, ``output/``); progress and page
    events are no-ops (the trainer's log lines still print)."""
    base = Path(base)
    models = base / "models"

    def progress(node_id: Any, total: int) -> Callable[..., None]:
        return lambda value, total=None: None

    files = {"diffusion_models": [models / "unet", models / "diffusion_models"],  # ComfyUI's order
             "checkpoints": [models / "checkpoints"]}
    return Host(base / "input", [models / "diffusers"], models / "loras", base / "output", progress,
                lambda: False, lambda event, data: None, files, base_dir=base)


def _comfyui_host() -> Host:  # pragma: no cover - exercised by the live ComfyUI tests
    import comfy.model_management
    import comfy.utils
    import folder_paths

    def progress(node_id: Any, total: int) -> Callable[..., None]:
        bar = comfy.utils.ProgressBar(total, node_id=node_id)

        def update(value: int, total: int | None = None) -> None:
            # ComfyUI's progress hook raises (and clears the flag) when the user interrupted: keep
            # the flag set instead, so the trainer sees `interrupted` at its next check, saves the
            # resumable state and returns; ComfyUI then stops before the next node.
            try:
                bar.update_absolute(value, total if total is not None else bar.total)
            except comfy.model_management.InterruptProcessingException:
                comfy.model_management.interrupt_current_processing(True)

        return update

    def send(event: str, data: dict) -> None:
        from server import PromptServer

        PromptServer.instance.send_sync(event, data)

    diffusers_dirs = [Path(p) for p in folder_paths.get_folder_paths("diffusers")]
    files = {name: [Path(p) for p in folder_paths.get_folder_paths(name)] for name in MODEL_FILE_FOLDERS}
    if GGUF_FOLDER in getattr(folder_paths, "folder_names_and_paths", {}):  # ComfyUI-GGUF is installed
        files["diffusion_models"] += [Path(p) for p in folder_paths.get_folder_paths(GGUF_FOLDER)]  # Host: once each
    return Host(Path(folder_paths.get_input_directory()), diffusers_dirs,
                Path(folder_paths.get_folder_paths("loras")[0]), Path(folder_paths.get_output_directory()),
                progress, comfy.model_management.processing_interrupted, send, files,
                comfy.model_management.throw_exception_if_processing_interrupted, Path(folder_paths.base_path),
                release_comfyui_models)


def release_comfyui_models() -> list[str]:
    """Inside ComfyUI, before a training run: unload the models its model management holds on the
    device and free its cached device memory (``comfy.model_management.unload_all_models`` and
    ``soft_empty_cache``, ComfyUI 0.3.64), so the run does not share the device with them (a sampling
    workflow's diffusion model, text encoders, VAE); ComfyUI loads them again when a node needs them.

    Returns:
        Log lines: the models it unloaded (their class and the bytes they held on the device), or
        that it held none.
    """
    import comfy.model_management as management

    def held() -> dict[int, tuple[str, int]]:
        out = {}
        for loaded in list(getattr(management, "current_loaded_models", [])):
            patcher = loaded.model
            if patcher is not None:
                out[id(patcher)] = (type(getattr(patcher, "model", patcher)).__name__, loaded.model_loaded_memory())
        return out

    before = held()
    management.unload_all_models()
    management.soft_empty_cache()
    unloaded = [before[key] for key in before.keys() - held().keys()]
    if not unloaded:
        return ["ComfyUI held no models on the device; its cached device memory was freed before training"]
    names = ", ".join(f"{name} ({size / 2**30:.3g} GiB)" for name, size in sorted(unloaded, key=lambda u: -u[1]))
    return [f"ComfyUI unloaded {len(unloaded)} model(s) before training: {names}; its cached device memory was freed"]


def model_folders(host: Host) -> list[str]:
    """Names of diffusers folders under the host's model directories (one level)."""
    names = set()
    for root in host.diffusers_dirs:
        if root.is_dir():
            names.update(p.name for p in root.iterdir() if p.is_dir())
    return sorted(names)


def _suffixes(kind: str) -> tuple[str, ...]:
    return MODEL_FILE_SUFFIXES.get(kind, (".safetensors",))


def model_files(host: Host) -> list[str]:
    """``<folder kind>/<relative path>`` of every model file under the host's single-file model
    folders: ``.safetensors``, and ``.gguf`` under ``diffusion_models`` (:data:`MODEL_FILE_SUFFIXES`;
    recursive, as ComfyUI lists them; hidden entries and links that lead outside the folder are
    left out)."""
    names = set()
    for kind, roots in host.model_file_dirs.items():
        for root in roots:
            for folder, dirs, files in os.walk(root):
                dirs[:] = [d for d in dirs if not d.startswith(".")]
                for name in files:
                    rel = (Path(folder) / name).relative_to(root).as_posix()
                    if name.endswith(_suffixes(kind)) and not name.startswith(".") and _inside(root, rel):
                        names.add(f"{kind}/{rel}")
    return sorted(names)


def _inside(root: Path, rel: str) -> bool:
    try:
        contained(root, rel, "source")
    except PathError:
        return False
    return True


def resolve_model(host: Host, name: str) -> Path:
    """The diffusers folder ``name`` under one of the host's diffusers directories, or the single
    model file ``<folder kind>/<relative path>`` (as :func:`model_files` lists it).

    Raises:
        PathError: outside every directory, not found, or a file of a kind the folder does not list
            (:data:`MODEL_FILE_SUFFIXES`).
    """
    kind, _, rel = name.partition("/") if isinstance(name, str) else ("", "", "")
    if kind in host.model_file_dirs and rel:
        for root in host.model_file_dirs[kind]:
            path = contained(root, rel, "source")
            if path.is_file() and path.name.endswith(_suffixes(kind)):
                return path
        raise PathError(f"source={_shown(name)} is invalid: no such {' or '.join(_suffixes(kind))} file under "
                        f"{host.folder_list(host.model_file_dirs[kind])}")
    for root in host.diffusers_dirs:
        path = contained(root, name, "source")
        if path.is_dir():
            return path
    raise PathError(f"source={name!r} is invalid: no such folder under {host.folder_list(host.diffusers_dirs)}")


RUN_DIGITS = 5


def numbered_run(root: Path, name: str, key: str = "run_name") -> Path:
    """A new run folder ``name_00001``, ``name_00002``, ... under ``root`` (the next free number),
    as ComfyUI's save nodes number their files: queueing a workflow again starts a new run. The
    folder is created here, atomically (``mkdir`` fails for all but one claimant), so two graphs
    queued into one name, on one server or two sharing the folder, never train into one folder.

    Raises:
        PathError: ``name`` leaves ``root`` (see :func:`contained`).
    """
    contained(root, name, key)
    taken = [n for n in _run_numbers(root, name)]
    number = (max(taken) if taken else 0) + 1
    while True:
        folder = contained(root, f"{name}_{number:0{RUN_DIGITS}d}", key)
        try:
            folder.mkdir(parents=True)
        except FileExistsError:  # another run claimed it since the folder was read
            number += 1
            continue
        return folder


def latest_run(root: Path, name: str, key: str = "run_name") -> Path | None:
    """The highest-numbered existing run folder of ``name`` (``None`` when there is none)."""
    contained(root, name, key)
    taken = _run_numbers(root, name)
    return contained(root, f"{name}_{max(taken):0{RUN_DIGITS}d}", key) if taken else None


def next_file(root: Path, prefix: str, suffix: str, key: str) -> Path:
    """A new file ``prefix_00001<suffix>``, ``_00002``, ... under ``root`` (the next free number),
    as ComfyUI's save nodes number theirs: nothing written earlier is replaced.

    Raises:
        PathError: ``prefix`` leaves ``root``.
    """
    first = contained(root, prefix, key)
    numbers = [p.name[len(first.name) + 1:-len(suffix)] for p in first.parent.glob(f"{first.name}_*{suffix}")]
    taken = [int(n) for n in numbers if n.isdigit()]
    return contained(root, f"{prefix}_{(max(taken) if taken else 0) + 1:0{RUN_DIGITS}d}{suffix}", key)


def _run_numbers(root: Path, name: str) -> list[int]:
    parent = (Path(root) / name).parent
    stem = Path(name).name
    if not parent.is_dir():
        return []
    found = []
    for path in parent.iterdir():
        head, _, number = path.name.rpartition("_")
        if path.is_dir() and head == stem and number.isdigit() and len(number) == RUN_DIGITS:
            found.append(int(number))
    return found


def package_module(name: str) -> str:
    """A module's dotted name inside the package ``segmented_checkpointing``, however it was
    imported: ComfyUI imports a custom-node pack under its folder's path (``/.../custom_nodes/<pack>``,
    dots as ``_x_``), and builds an error's ``exception_type`` from its class's ``__module__``, which
    reaches the page and ``/history``; this name holds no path."""
    inner = name.partition(".")[2]
    return f"segmented_checkpointing.{inner}" if inner else "segmented_checkpointing"


class NodeError(ValueError):
    """An error a node reports to the page: the engine's message with server paths hidden and the
    options named by the nodes' inputs."""


NodeError.__module__ = PathError.__module__ = package_module(__name__)


def node_error(exc: BaseException) -> NodeError:
    """``exc`` as the page shows it: server paths hidden (:meth:`Host.public`), the command line's
    flags and keys as the nodes name them (:func:`~.messages.node_words`)."""
    from .messages import node_words

    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)  # a KeyError's str() is quoted
    return NodeError(current_host().public(node_words(text)))


def _ours(exc: BaseException) -> bool:
    """Whether ``exc``'s class is one of the pack's (its module name carries the pack's path)."""
    return type(exc).__module__.partition(".")[0] == __name__.partition(".")[0]


def public_errors(function: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a node's function: the project's errors (every ``ValueError``, file errors, any
    exception class of the pack) reach the page as :class:`NodeError` (:func:`node_error`): no
    absolute path in its message or its type's name. A measurement that the user cancelled ends
    the prompt as interrupted (the host's own exception)."""
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except NodeError:
            raise
        except Exception as exc:
            if type(exc).__name__ in ("MeasurementInterrupted", "PlanInterrupted") and _ours(exc):
                current_host().raise_interrupt()
            if isinstance(exc, (ValueError, OSError)) or _ours(exc):
                raise node_error(exc) from None
            raise

    return wrapper
