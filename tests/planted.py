"""A repository whose every configuration source names a program: what code a verifier
runs (the agent wrote it) could plant, and what ratchet must never run."""

from __future__ import annotations

from pathlib import Path

# Every configuration source that can name a program git runs: (name, config lines).
# ``{p}`` is replaced by the path of a script that records its own name when run.
SOURCES: dict[str, list[str]] = {
    "fsmonitor": ["[core]", "\tfsmonitor = {p}"],
    "hooks": ["[core]", "\thooksPath = {hooks}"],
    "filter": ['[filter "evil"]', "\tclean = {p}", "\tsmudge = {p}"],
    "textconv": ['[diff "evil"]', "\ttextconv = {p}", "\tcommand = {p}"],
    "pager": ["[core]", "\tpager = {p}", "[pager]", "\tstatus = {p}"],
    "include": ["[include]", "\tpath = {inc}"],
    "includeIf": ['[includeIf "gitdir:/"]', "\tpath = {inc}"],
    "sshCommand": ["[core]", "\tsshCommand = {p}"],
    "alias": ["[alias]", "\tstatus = !{p}", "\trev-parse = !{p}"],
    "editor": ["[core]", "\teditor = {p}", "[sequence]", "\teditor = {p}"],
    "askpass": ["[core]", "\taskPass = {p}", "[credential]", "\thelper = !{p}"],
}
HOOKS = ("post-index-change", "pre-commit", "post-checkout", "reference-transaction")


def script(folder: Path, name: str, markers: Path) -> Path:
    path = folder / f"evil-{name}"
    path.write_text(f"#!/bin/sh\necho ran >> {markers / name}\ncat >/dev/null 2>&1\nexit 0\n")
    path.chmod(0o755)
    return path


def plant(root: Path, markers: Path) -> None:
    """Point every configuration source of the repository at ``root`` to a program that
    leaves a marker named after its source in ``markers``."""
    markers.mkdir(exist_ok=True)
    bin_dir = root.parent / "evil-bin"
    bin_dir.mkdir(exist_ok=True)
    hooks = root.parent / "evil-hooks"
    hooks.mkdir(exist_ok=True)
    for hook in HOOKS:
        target = hooks / hook
        target.write_text(f"#!/bin/sh\necho ran >> {markers / ('hook-' + hook)}\n")
        target.chmod(0o755)
    included = root.parent / "evil-included.config"
    included.write_text(f"[core]\n\tfsmonitor = {script(bin_dir, 'included', markers)}\n")
    lines: list[str] = []
    for name, template in SOURCES.items():
        program = script(bin_dir, name, markers)
        lines += [line.format(p=program, hooks=hooks, inc=included) for line in template]
    with (root / ".git" / "config").open("a") as config:
        config.write("\n".join(lines) + "\n")
    (root / ".gitattributes").write_text("* filter=evil diff=evil\n")


def ran(markers: Path) -> list[str]:
    return sorted(p.name for p in markers.iterdir()) if markers.exists() else []
