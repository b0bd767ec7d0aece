"""The tested set of dependency versions (.ci/constraints.txt): write it from a passing venv, check a venv against it.

    python .ci/constraints.py write .ci/constraints.txt   # from the running venv (.ci/run --latest --update-constraints)
    python .ci/constraints.py check .ci/constraints.txt   # the running venv is the tested set (.ci/run)
    python .ci/constraints.py diff .ci/constraints.txt    # what the newest releases changed (.ci/run --latest)

Standard library only: it runs in a venv before anything else is known to work.
"""
import platform
import re
import sys
from datetime import datetime, timezone
from importlib.metadata import distributions
from pathlib import Path

PROJECT = "grpo-lab"
NOT_PINNED = {"pip"}  # .ci/run upgrades pip itself before installing anything


def canonical(name: str) -> str:
    "A distribution name as pip compares them (PEP 503)."
    return re.sub(r"[-_.]+", "-", name).lower()


def public(version: str) -> str:
    "A version without its local label: torch 2.13.0+cpu is pinned as torch==2.13.0, which CPU and CUDA builds meet."
    return version.split("+")[0]


def installed() -> dict[str, tuple[str, str]]:
    "{canonical name: (name, version)} of the running environment, the project itself left out."
    found = {}
    for dist in distributions():
        name = dist.metadata["Name"]
        if name and canonical(name) not in {canonical(PROJECT)} | NOT_PINNED:
            found[canonical(name)] = (name, dist.version)
    return found


def read(path: Path) -> dict[str, str]:
    "{canonical name: version} of a constraints file of `name==version` lines."
    pins = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not version.strip():
            sys.exit(f"{path}:{number}: {line!r} is not 'name==version'; the file holds exact versions only.")
        pins[canonical(name.strip())] = version.strip()
    return pins


def write(path: Path) -> None:
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    lines = [f"# The tested set: every package of a venv in which `bash .ci/run --latest` passed, {now},",
             f"# Python {platform.python_version()} on {platform.system()} {platform.machine()}. Written by",
             "# `bash .ci/run --latest --update-constraints`; commit a change to it on its own. Exact versions only.",
             *sorted(f"{name}=={public(version)}" for name, version in installed().values())]
    path.write_text("\n".join(lines) + "\n")
    print(f"{path}: {len(lines) - 3} packages")


def check(path: Path) -> int:
    "Exit 1 when an installed version differs from its pin; name the packages the constraints do not pin."
    pins, have = read(path), installed()
    wrong = [f"{name} {version} (pinned {pins[key]})" for key, (name, version) in sorted(have.items())
             if key in pins and public(version) != pins[key]]
    loose = [f"{name} {version}" for key, (name, version) in sorted(have.items()) if key not in pins]
    if loose:
        print(f"{path.name} does not pin {len(loose)} installed package(s), installed at their newest release: "
              f"{', '.join(loose)}. Refresh it: bash .ci/run --latest --update-constraints")
    if wrong:
        print(f"installed versions differ from {path.name}: {', '.join(wrong)}", file=sys.stderr)
        return 1
    print(f"{len(have) - len(loose)} packages at the versions of {path.name}")
    return 0


def diff(path: Path) -> int:
    "Print what the running venv (the newest releases) has that differs from the tested set; exit 1 if anything does."
    pins, have = read(path), installed()
    changed = [f"  {name}: {pins[key]} -> {public(version)}" for key, (name, version) in sorted(have.items())
               if key in pins and public(version) != pins[key]]
    added = [f"  {name}: new, {public(version)}" for key, (name, version) in sorted(have.items()) if key not in pins]
    gone = [f"  {key}: {pins[key]}, no longer installed" for key in sorted(pins) if key not in have]
    if not (changed or added or gone):
        print(f"the newest releases are the tested set ({path.name}): nothing moved")
        return 0
    print(f"the newest releases differ from the tested set ({path.name}):", *changed, *added, *gone, sep="\n")
    return 1


if __name__ == "__main__":
    commands = {"write": write, "check": check, "diff": diff}
    if len(sys.argv) != 3 or sys.argv[1] not in commands:
        sys.exit(f"usage: python .ci/constraints.py {{{','.join(commands)}}} PATH")
    sys.exit(commands[sys.argv[1]](Path(sys.argv[2])))
