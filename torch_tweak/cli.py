"""The ``torch-tweak`` command line: ``demo``, ``report``, ``verify`` and ``cache``.

Every command has ``--help``. Errors are reported as one line on stderr with a non-zero exit status
(1 for a failed command, 2 for bad usage, 130 when interrupted); tracebacks are only shown with
``TORCH_TWEAK_DEBUG=1``. Heavy modules (torch, the backends) are imported by the commands that need them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def _demo(args: argparse.Namespace) -> int:
    from torch_tweak.demo import run_demo
    from torch_tweak.torch.cache import cache_folder

    out = Path(args.out) if args.out else cache_folder("demo")
    kind = "quick demo (eager only)" if args.quick else "demo (every CPU backend available)"
    print(f"torch-tweak: tuning the built-in CNN and transformer encoder, {kind}; this can take a few minutes...",
          file=sys.stderr, flush=True)
    result = run_demo(out, quick=args.quick)
    print(result.report)
    print()
    print(f"JSON report:  {result.json_path}")
    print(f"HTML report:  {result.html_path}")
    if result.checkpoint_path is not None:
        print(f"checkpoint:   {result.checkpoint_path}  (check it with: torch-tweak verify {result.checkpoint_path})")
    else:
        print(f"checkpoint:   not written ({result.checkpoint_error or 'tt.save is not available in this version'})")
    return 0


def _report(args: argparse.Namespace) -> int:
    from torch_tweak.torch.report import TuningReport

    report = TuningReport.load(args.file)
    print(report)
    if args.html:
        path = report.save_html(args.html)
        print(f"HTML report: {path}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        raise FileNotFoundError(f"there is no checkpoint file at {path}")
    try:
        from torch_tweak.torch.checkpoint.verify import verify
    except ImportError as exc:
        raise RuntimeError(f"this torch_tweak has no checkpoint verification ({exc})") from exc
    summary = verify(path)
    print(f"OK: {summary['path']} (format {summary['format_version']}, created {summary.get('created') or '?'})")
    for module in summary["modules"]:
        graphs = ", ".join(f"graph {g['name']}: {g['backend']}" for g in module["graphs"])
        print(f"  module {module['name']} at {module['path'] or '<root>'} ({module['class']}): {graphs}")
    print("  signed: " + ("yes (tt.load(..., verify_key=...) checks the signature)" if summary.get("signed") else
                          "no (the sums file proves the file is intact, not who wrote it)"))
    if summary.get("native_code"):
        print(f"  native code: module(s) {', '.join(summary['native_code'])} run compiled code when loaded; tt.load "
              "refuses them unless trust_native_code=True or a verify_key matches the signature")
    if summary.get("warm_native_code"):
        print(f"  warm-load packages (native code): module(s) {', '.join(summary['warm_native_code'])} load without "
              "compiling only with trust_native_code=True or a matching verify_key; otherwise they compile at load")
    changes = summary.get("environment_changes") or {}
    if changes.get("missing_cpu_flags"):
        print(f"  note: saved on a CPU with {', '.join(changes['missing_cpu_flags'])}, which this CPU lacks")
    for name, (saved, current) in (changes.get("versions") or {}).items():
        print(f"  note: {name} was {saved} when saved, is {current} here")
    return 0


def _cache(args: argparse.Namespace) -> int:
    from torch_tweak.torch.config import config

    if args.cache_dir:
        config.cache_dir = args.cache_dir
    root = Path(config.cache_dir)
    if args.action == "list":
        _list_cache(root)
    else:
        _clear_cache(root)
    return 0


def _size(path: Path) -> tuple[int, int]:
    """Files and bytes under ``path`` (symbolic links are not followed; a file or link counts as itself)."""
    if path.is_symlink() or not path.is_dir():
        try:
            return 1, os.lstat(path).st_size
        except OSError:
            return 0, 0
    files = total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            files += 1
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return files, total


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def _list_cache(root: Path) -> None:
    from torch_tweak.torch.cache import CACHE_MARKER, read_marker

    if not os.path.lexists(root):
        print(f"cache folder {root} does not exist: nothing is cached")
        return
    if not root.is_dir():
        raise NotADirectoryError(f"the cache folder {root} is not a folder")
    marker = read_marker(root)
    files, total = _size(root)
    if marker is None:
        print(f"cache folder {root}: {files} files, {_human(total)} (no valid {CACHE_MARKER} marker: not created by "
              "torch_tweak; `torch-tweak cache clear` refuses it)")
        return
    adopted = "" if marker.created_root else " (an existing folder torch_tweak uses: clearing keeps the folder itself)"
    from torch_tweak.torch.config import config

    limit = config.cache_size_limit_gb
    bound = "no size limit" if limit is None else f"least recently used items beyond {limit:g} GB go after tt.tune"
    print(f"cache folder {root}: {files} files, {_human(total)}{adopted}; {bound}")
    for entry in sorted(root.iterdir()):
        if entry.name == CACHE_MARKER:
            continue
        n, size = _size(entry)
        if entry.name not in marker.entries:
            print(f"  {entry.name}{'/' if entry.is_dir() else ''}  not torch_tweak's: `cache clear` keeps it")
            continue
        if entry.is_symlink() or not entry.is_dir():
            print(f"  {entry.name}  no longer a folder: `cache clear` removes it (not what it points to)")
            continue
        if entry.name == "reports":
            reports = sorted(p.name for p in entry.glob("*.json"))
            newest = f", newest {entry / reports[-1]}" if reports else ""
            print(f"  reports/  {len(reports)} tuning reports, {_human(size)}{newest}")
            continue
        graphs = [g for g in sorted(entry.iterdir()) if g.is_dir() and not g.is_symlink()]
        if not graphs:  # e.g. the demo's outputs
            print(f"  {entry.name}/  {n} files, {_human(size)}")
            continue
        builds = sum(1 for g in graphs for b in g.iterdir() if b.is_dir())
        print(f"  {entry.name}/  {len(graphs)} graphs, {builds} candidate builds, {n} files, {_human(size)}")


def _clear_cache(root: Path) -> None:
    from torch_tweak.torch.cache import clear_cache, read_marker

    if not os.path.lexists(root):
        print(f"cache folder {root} does not exist: nothing to clear")
        return
    marker = None if root.is_symlink() or not root.is_dir() else read_marker(root)
    files = total = 0
    for name in sorted(marker.entries) if marker is not None else ():
        if os.path.lexists(root / name):
            n, size = _size(root / name)
            files, total = files + n, total + size
    clear_cache()  # refuses a folder without a valid marker, or a symbolic link
    removed = f"{files} files, {_human(total)}"
    if not os.path.lexists(root):
        print(f"cleared {root} ({removed})")
        return
    kept = sorted(entry.name for entry in root.iterdir())
    why = "torch_tweak did not create it" if marker is None or not marker.created_root else "it holds files torch_tweak did not write"
    listed = f"; not torch_tweak's, kept: {', '.join(kept[:10])}{', ...' if len(kept) > 10 else ''}" if kept else ""
    print(f"cleared torch_tweak's files from {root} ({removed}); kept the folder itself ({why}){listed}")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``torch-tweak`` (one sub-command each)."""
    parser = argparse.ArgumentParser(prog="torch-tweak", description="Tune PyTorch models for inference: run the "
                                     "demo, read tuning reports, verify checkpoints, manage the cache.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser("demo", help="tune a built-in CNN and transformer encoder with every CPU backend",
                               description="Tune the built-in CNN and transformer encoder with every CPU backend "
                               "(HighestThroughputStrategy), print the report, write it as JSON and HTML and save a "
                               "checkpoint.")
    demo.add_argument("--out", metavar="DIR", help="output folder (default: <cache dir>/demo)")
    demo.add_argument("--quick", action="store_true", help="eager only, short measurements (a few seconds)")
    demo.set_defaults(func=_demo)

    report = commands.add_parser("report", help="print a saved tuning report, optionally as HTML",
                                 description="Print a tuning report written by tt.tune (<cache dir>/reports/*.json) "
                                 "or by TuningReport.to_json, and optionally render it to one HTML file.")
    report.add_argument("file", metavar="FILE.json", help="the report's JSON file")
    report.add_argument("--html", metavar="OUT", help="also write the HTML report to OUT")
    report.set_defaults(func=_report)

    verify = commands.add_parser("verify", help="check a checkpoint's integrity without loading any backend",
                                 description="Check every member of a checkpoint written by tt.save (sizes and "
                                 "SHA-256 against its manifest and sums file) without loading any backend.")
    verify.add_argument("file", metavar="FILE.tt", help="the checkpoint")
    verify.set_defaults(func=_verify)

    cache = commands.add_parser("cache", help="list or clear torch_tweak's cache folder",
                                description="List or clear torch_tweak's cache folder (tt.config.cache_dir, "
                                "TORCH_TWEAK_CACHE_DIR). Clearing deletes only what torch_tweak wrote there (as its "
                                ".torch_tweak_cache marker records) and refuses a folder without that marker.")
    cache.add_argument("action", choices=["list", "clear"], help="list: show what is cached; clear: delete what torch_tweak wrote")
    cache.add_argument("--cache-dir", metavar="DIR", help="the cache folder (default: tt.config.cache_dir)")
    cache.set_defaults(func=_cache)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``torch-tweak``; returns the exit status."""
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print(f"torch-tweak {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI reports errors as one line
        if os.environ.get("TORCH_TWEAK_DEBUG"):
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"torch-tweak {args.command}: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
