"""Run configs shipped with the lab, named by preset: `--config transformer` is
scripts/lab/configs/transformer.json, installed as package data."""

from __future__ import annotations

from pathlib import Path

from dtlab.models.config import ConfigError

CONFIGS = Path(__file__).resolve().parent / "configs"
DEFAULT = "transformer"


def names() -> list[str]:
    return sorted(p.stem for p in CONFIGS.glob("*.json"))


def config_path(name_or_path: str) -> Path:
    """A preset's file, or `name_or_path` itself when it names a file."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        return path
    preset = CONFIGS / f"{name_or_path}.json"
    if not preset.exists():
        raise ConfigError(f"--config {name_or_path}: no such file and no such preset "
                          f"(presets: {', '.join(names())})")
    return preset


def resolve(argv: list[str]) -> list[str]:
    """argv with a preset name after --config replaced by its file."""
    out = list(argv)
    for i, a in enumerate(out):
        if a == "--config" and i + 1 < len(out):
            out[i + 1] = str(config_path(out[i + 1]))
        elif a.startswith("--config="):
            out[i] = "--config=" + str(config_path(a.split("=", 1)[1]))
    return out
