"""Generate docs/configuration.md from conf/: `python -m ddpm.config.doc [--check]`.

Every yaml file documents itself: its header comment (the leading `#` lines) says what the option is,
and each key's comment (at the end of its line, or on the line above) says what the key does. A key
under a `_target_` without a comment takes the comment of the matching constructor argument (our
classes: `name: type = default,  # comment`) or its Google-style docstring entry (Lightning's classes).
Keys of `# @package _global_` files (experiments, searches) set keys documented in their own groups.
`undocumented()` lists what lacks a description; tests/test_config_doc.py keeps that list empty.
"""

import argparse
import inspect
import re
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
CONF, DOC = REPO / "conf", REPO / "docs" / "configuration.md"
KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][\w.\-/]*|\"[^\"]+\")\s*:(?:\s+(?P<rest>.*))?$")
UNDOCUMENTED_OK = {"_target_", "_partial_", "defaults"}


@dataclass
class Entry:
    path: str  # dotted key inside the file's package
    value: str  # the value as written ("" for a mapping)
    comment: str  # its comment, "" if none


@dataclass
class ConfigFile:
    group: str  # "" for a primary config (train.yaml), else e.g. "model" or "hydra/launcher"
    name: str  # option name (file stem)
    header: str  # the leading comment block
    is_global: bool  # `# @package _global_`
    entries: list[Entry] = field(default_factory=list)
    defaults: list[str] = field(default_factory=list)


def split_comment(text: str) -> tuple[str, str]:
    """'value  # comment' -> ('value', 'comment'); a # inside quotes or ${...} stays in the value."""
    quote, depth = "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == "#" and depth == 0 and (i == 0 or text[i - 1].isspace()):
            return text[:i].strip(), text[i + 1 :].strip()
    return text.strip(), ""


def parse(path: Path, root: Path = CONF) -> ConfigFile:
    lines = path.read_text().splitlines()
    rel = path.relative_to(root)
    header, i = [], 0
    while i < len(lines) and lines[i].lstrip().startswith("#"):
        header.append(lines[i].lstrip()[1:].strip())
        i += 1
    is_global = any(h.replace(" ", "") == "@package_global_" for h in header)
    header = [h for h in header if not h.startswith("@package")]
    cfg = ConfigFile(str(rel.parent) if rel.parent != Path() else "", rel.stem, " ".join(header), is_global)
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    for line in lines[i:]:
        stripped = line.strip()
        if not stripped:
            pending = []
        elif stripped.startswith("#"):
            pending.append(stripped[1:].strip())
        elif stripped.startswith("- "):
            item, _ = split_comment(stripped[2:])
            if stack and stack[-1][1] == "defaults":
                cfg.defaults.append(item)
            elif cfg.entries:
                last = cfg.entries[-1]
                last.value = f"{last.value[:-1]}, {item}]" if last.value.startswith("[") else f"[{item}]"
        elif match := KEY.match(line):
            indent, key = len(match["indent"]), match["key"].strip('"')
            while stack and stack[-1][0] >= indent:
                stack.pop()
            value, comment = split_comment(match["rest"] or "")
            if key != "defaults" and not (stack and stack[0][1] == "defaults"):
                dotted = ".".join([k for _, k in stack] + [key])
                cfg.entries.append(Entry(dotted, value, comment or " ".join(pending)))
            stack.append((indent, key))
            pending = []
    return cfg


def load(conf: Path = CONF) -> list[ConfigFile]:
    return [parse(p, conf) for p in sorted(conf.rglob("*.yaml"))]


@cache
def target_docs(target: str) -> dict[str, str]:
    """Argument descriptions of a `_target_`: source comments `name: ... # text`, then docstring Args."""
    try:
        from hydra.utils import get_object

        obj = get_object(target)
    except Exception:
        return {}
    docs: dict[str, str] = {}
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError):
        source = ""
    for line in source.splitlines():
        if m := re.match(r"^\s*(\w+)\s*:[^#]*#\s*(.+)$", line):
            docs.setdefault(m[1], m[2].strip())
    for doc in (inspect.getdoc(obj) or "", inspect.getdoc(getattr(obj, "__init__", None)) or ""):
        for name, text in docstring_args(doc).items():
            docs.setdefault(name, text)
    return docs


def docstring_args(doc: str) -> dict[str, str]:
    """Google-style 'Args:' entries, first sentence of each."""
    out, name, section = {}, None, False
    for line in doc.splitlines():
        if line.strip() in ("Args:", "Arguments:", "Parameters:"):
            section, base = True, None
            continue
        if not section:
            continue
        if line.strip() and not line.startswith(" "):
            break
        m = re.match(r"^( +)\**(\w+)(?: \([^)]*\))?:\s*(.*)$", line)
        if m and (base is None or len(m[1]) == base):
            base, name = len(m[1]), m[2]
            out[name] = m[3]
            continue
        if name and line.strip():
            out[name] = f"{out[name]} {line.strip()}".strip()
    return {k: re.split(r"(?<=[.!?])\s", v.replace("``", "`"), maxsplit=1)[0] for k, v in out.items() if v}


def describe(cfg: ConfigFile, entry: Entry) -> str:
    """The entry's comment, else its `_target_`'s argument doc."""
    if entry.comment:
        return entry.comment
    values = {e.path: e.value for e in cfg.entries}
    parts = entry.path.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        target = values.get(".".join([*parts[:cut], "_target_"]))
        if target:
            return target_docs(target).get(parts[cut], "")
    return ""


def group_descriptions(files: list[ConfigFile]) -> dict[tuple[str, str], str]:
    """(group, key) -> description, from any option of the group (options share their keys' meaning)."""
    out: dict[tuple[str, str], str] = {}
    for cfg in files:
        for entry in cfg.entries:
            text = describe(cfg, entry)
            if text:
                out.setdefault((scope(cfg), entry.path), text)
    return out


def scope(cfg: ConfigFile) -> str:
    """Where a key's meaning is shared: its group, or the primary config file itself."""
    return cfg.group or f"{cfg.name}.yaml"


def is_leaf(cfg: ConfigFile, entry: Entry) -> bool:
    return entry.value != "" or not any(e.path.startswith(entry.path + ".") for e in cfg.entries)


def undocumented(files: list[ConfigFile] | None = None) -> list[str]:
    """'conf/<file>' for an option without a header comment, 'conf/<file>: key' for an unexplained key."""
    files = load() if files is None else files
    descriptions, missing = group_descriptions(files), []
    for cfg in files:
        where = f"conf/{cfg.group + '/' if cfg.group else ''}{cfg.name}.yaml"
        if not cfg.header:
            missing.append(where)
        for entry in cfg.entries:
            last, (head, _, rest) = entry.path.split(".")[-1], entry.path.partition(".")
            in_group = cfg.is_global and ((head, rest) in descriptions or ("train.yaml", entry.path) in descriptions)
            if last in UNDOCUMENTED_OK or not is_leaf(cfg, entry) or (scope(cfg), entry.path) in descriptions:
                continue
            if not in_group:  # an experiment's data.batch_size is documented in group data
                missing.append(f"{where}: {entry.path}")
    return missing


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;")


def render(files: list[ConfigFile] | None = None) -> str:
    files = load() if files is None else files
    descriptions = group_descriptions(files)
    out = [
        "# Configuration",
        "",
        "Generated from `conf/` by `python -m ddpm.config.doc`; edit the yaml comments, not this file.",
        "Choose an option with `group=option` (`python train.py model=unet_mnist`), set a key with",
        "`group.key=value`; the `experiment` bundles set keys of several groups at once.",
        "",
    ]
    primaries = [f for f in files if not f.group]
    groups = sorted({f.group for f in files if f.group})
    for cfg in primaries:
        out += [f"## `{cfg.name}.yaml`", "", cfg.header, ""]
        if cfg.defaults:
            out += ["Defaults: " + ", ".join(f"`{d}`" for d in cfg.defaults), ""]
        out += table(scope(cfg), [cfg], descriptions)
    for group in groups:
        options = [f for f in files if f.group == group]
        out += [f"## `{group}`", ""]
        out += [f"- `{group}={o.name}`: {_md(o.header)}" for o in options] + [""]
        out += table(group, options, descriptions)
    return "\n".join(out).rstrip() + "\n"


def table(group: str, options: list[ConfigFile], descriptions: dict) -> list[str]:
    keys = list(dict.fromkeys(e.path for o in options for e in o.entries if is_leaf(o, e)))
    if not keys:
        return []
    names = [o.name for o in options]
    rows = ["| key | " + " | ".join(f"`{n}`" for n in names) + " | description |"]
    rows.append("|---" * (len(names) + 2) + "|")
    for key in keys:
        values = [{e.path: e.value for e in o.entries}.get(key) for o in options]
        cells = ["–" if v is None else f"`{_md(v)}`" if v else "" for v in values]
        head, _, rest = key.partition(".")  # a _global_ file's `optim.lr` is documented in group optim
        glob = all(o.is_global for o in options)  # an experiment's keys are documented in their own groups
        neutral = (descriptions.get((head, rest)) or descriptions.get(("train.yaml", key))) if glob else None
        text = (
            shared_comment(options, key, neutral)
            or neutral
            or (per_option(options, key) if glob else "")
            or descriptions.get((group, key))
            or ("the class instantiated" if key.endswith("_target_") else "")
        )
        rows.append(f"| `{key}` | " + " | ".join(cells) + f" | {_md(text)} |")
    return [*rows, ""]


def shared_comment(options: list[ConfigFile], key: str, neutral: str | None) -> str:
    """For a key documented in its own group (`neutral`: an experiment's `data.batch_size`), the options' comment
    where every option setting the key says the same; else "" (the neutral description stands): one experiment's
    note (mnist's EMA warm-up) must not stand beside the other experiments' values."""
    said = {describe(o, e) for o in options for e in o.entries if e.path == key}
    setting = sum(any(e.path == key for e in o.entries) for o in options)
    commented = sum(bool(describe(o, e)) for o in options for e in o.entries if e.path == key)
    return next(iter(said)) if neutral and len(said) == 1 and commented == setting else ""


def per_option(options: list[ConfigFile], key: str) -> str:
    """Each option's comment, named, where the options setting the key say different things (a search space's
    `ema.decay`: inert in one study, not in the other); else ""."""
    said = {o.name: text for o in options for e in o.entries if e.path == key and (text := describe(o, e))}
    return "; ".join(f"{name}: {text}" for name, text in said.items()) if len(set(said.values())) > 1 else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the doc is stale or a key lacks a comment")
    args = parser.parse_args(argv)
    files = load()
    missing, text = undocumented(files), render(files)
    for item in missing:
        print(f"undocumented: {item}", file=sys.stderr)
    if args.check:
        stale = not DOC.is_file() or DOC.read_text() != text
        if stale:
            print(f"{DOC} is stale: run python -m ddpm.config.doc", file=sys.stderr)
        return int(stale or bool(missing))
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)
    print(f"wrote {DOC} ({len(files)} config files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
