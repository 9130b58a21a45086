"""The README and docs/*.md say only what is true of this checkout.

For README.md and every docs/*.md page:

- every relative link (and image) points at a file or folder that exists,
  and an anchor (`page.md#section`, `#section`) at a heading of that page;
- every ```python block parses, and its `mlx_spec` / `training` / `bench` imports name
  modules (and names) that exist;
- every command line in ```bash / ```sh / ```shell / ```console blocks is one
  that would run: `mlx-spec ...` is parsed by the real click command (nothing
  runs), `python -m X` finds module X, `python path.py` finds the file,
  `make X` finds the Makefile target, `bash path` finds the script, and any
  other program must be on a short allow-list, so a typo'd command fails;
- the README stays short (at most README_MAX_LINES lines).

Nothing here loads a model or imports MLX; the checker functions are also fed
bad input (test_checkers_report_*) so that the checks can be seen to fail.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
REPO_PACKAGES = {"mlx_spec", "training", "bench"}  # resolved as files in this checkout, never imported

# Programs a command line may start with besides those checked in detail below.
ALLOWED_PROGRAMS = {
    "pip", "pip3", "uv", "git", "curl", "wget", "apt-get", "apt", "brew", "cd", "export",
    "source", "echo", "cat", "ls", "mkdir", "rm", "cp", "ssh", "kill", "nproc",
    "mlx.distributed_config", "huggingface-cli", "pytest",
}
WRAPPERS = {"nice": {"-n"}, "time": set(), "env": set(), "timeout": set()}  # name -> options taking a value
PYTHON_NAME = re.compile(r"python(3(\.\d+)?)?$")
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
SEPARATORS = {"|", "||", "&&", ";", "&"}


# ---------------------------------------------------------------- Markdown


def fenced_blocks(text: str):
    """[(language, body, line number of the opening fence)], fences indented or not."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        match = re.match(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not match:
            i += 1
            continue
        indent, fence, lang = len(match.group(1)), match.group(2), match.group(3).lower()
        start, body, i = i + 1, [], i + 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            line = lines[i]
            body.append(line[indent:] if line[:indent].strip() == "" else line)
            i += 1
        blocks.append((lang, "\n".join(body), start))
        i += 1
    return blocks


def prose(text: str, inline_code: bool = False) -> str:
    """The page without its fenced blocks and, unless asked to keep it, inline code
    (links there are not links)."""
    kept, inside, fence = [], False, ""
    for line in text.splitlines():
        match = re.match(r"^\s*(`{3,}|~{3,})", line)
        if match and (not inside or line.strip().startswith(fence)):
            inside, fence = (not inside), match.group(1)
            kept.append("")
            continue
        kept.append("" if inside else line if inline_code else re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"`|\*\*|__", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set:
    """The anchors of a page's headings (a repeated heading gets -1, -2, ...)."""
    seen, found = {}, set()
    for line in prose(text, inline_code=True).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            n = seen.get(base, 0)
            found.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
    return found


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def check_links(page: Path, text: str | None = None) -> list:
    """Problems with the page's relative links: missing targets and anchors."""
    text = page.read_text() if text is None else text
    problems = []
    for target in LINK.findall(prose(text)):
        if re.match(r"^(https?:|mailto:|ftp:)", target):
            continue
        path_part, _, anchor = target.partition("#")
        dest = page.resolve() if not path_part else (page.parent / path_part).resolve()
        if not dest.exists():
            problems.append(f"{page.name}: link to {target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and dest.is_file():
            if anchor not in anchors(text if dest == page.resolve() else dest.read_text()):
                problems.append(f"{page.name}: link to {target}: no heading #{anchor} in {dest.name}")
    return problems


# ------------------------------------------------------ modules and python


def repo_module(name: str):
    """The file that module `name` of this checkout lives in (None if none)."""
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def module_exists(name: str) -> bool:
    if name.split(".")[0] in REPO_PACKAGES:
        return repo_module(name) is not None
    return importlib.util.find_spec(name.split(".")[0]) is not None  # a third party's top level


def retired_studies() -> set:
    """The studies bench/README.md lists as retired (their code is in git history)."""
    text = (ROOT / "bench" / "README.md").read_text()
    if "## Retired studies" not in text:
        return set()
    section = text.split("## Retired studies", 1)[1].split("\n## ", 1)[0]
    return {f"bench.studies.{name}" for name in re.findall(r"^- `(\w+)`:", section, re.M)}


def runnable_module(name: str) -> bool:
    """`python -m name` would find something to run (or ran, at the commit a retired study's
    entry names)."""
    if name in retired_studies():
        return True
    if name.split(".")[0] in REPO_PACKAGES:
        found = repo_module(name)
        if found is not None and found.name == "__init__.py":
            return (found.parent / "__main__.py").is_file()
        return found is not None
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if spec.submodule_search_locations is not None:  # a package: needs its __main__
        return importlib.util.find_spec(name + ".__main__") is not None
    return True


def defined_names(path: Path) -> set:
    """Names a module defines or imports at its top level, plus those in `__all__`."""
    tree, names = ast.parse(path.read_text()), set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            if any(isinstance(t, ast.Name) and t.id in ("__all__", "_HOMES") for t in targets):
                names.update(c.value for c in ast.walk(node.value)
                             if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return names


def check_python(code: str, where: str = "") -> list:
    """Problems with a python snippet: a syntax error, or an import of this repo that fails."""
    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        return [f"{where}: python does not parse: {exc.msg} (line {exc.lineno})"]
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in REPO_PACKAGES and not module_exists(alias.name):
                    problems.append(f"{where}: import {alias.name}: no such module")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] not in REPO_PACKAGES:
                continue
            path = repo_module(node.module)
            if path is None:
                problems.append(f"{where}: from {node.module}: no such module")
                continue
            names = defined_names(path)
            for alias in node.names:
                if alias.name == "*" or alias.name in names or repo_module(f"{node.module}.{alias.name}"):
                    continue
                problems.append(f"{where}: from {node.module} import {alias.name}: not defined there")
    return problems


# ----------------------------------------------------------- command lines


def command_lines(lang: str, body: str):
    """The command lines of a shell block: `\\` continuations joined; in console blocks
    only the lines after a `$ ` prompt (the rest is output)."""
    lines, current = [], ""
    for raw in body.splitlines():
        line = raw.rstrip()
        if lang == "console" and not current:
            if not line.lstrip().startswith("$ "):
                continue
            line = line.lstrip()[2:]
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        if current.strip() and not current.strip().startswith("#"):
            lines.append(current.strip())
        current = ""
    if current.strip():
        lines.append(current.strip())
    return lines


def split_commands(line: str):
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands, current = [], []
    for token in lexer:
        if token in SEPARATORS:
            if current:
                commands.append(current)
            current = []
        else:
            current.append(token)
    if current:
        commands.append(current)
    return commands


def makefile_targets() -> set:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.MULTILINE)}


def check_mlx_spec_args(args: list) -> list:
    """Parse `mlx-spec ARGS` with the real click command, running nothing."""
    import click

    from mlx_spec.cli import main

    shown = "mlx-spec " + " ".join(args)
    try:
        with contextlib.chdir(ROOT), contextlib.redirect_stdout(io.StringIO()):  # paths as from the root
            ctx = main.make_context("mlx-spec", list(args), resilient_parsing=False)
            rest = [*(getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", [])),
                    *ctx.args]
            if not rest:
                return [f"{shown}: no subcommand"]
            name, command, rest = main.resolve_command(ctx, rest)
            command.make_context(name, list(rest), parent=ctx)
    except click.exceptions.Exit as exc:  # --help, --version
        return [] if exc.exit_code == 0 else [f"{shown}: exits {exc.exit_code}"]
    except click.ClickException as exc:
        return [f"{shown}: {exc.format_message()}"]
    return []


def check_python_command(args: list, shown: str) -> list:
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-m", "-c"):
        i += 2 if args[i] in ("-X", "-W") else 1
    if i >= len(args):
        return []  # an interactive interpreter
    if args[i] == "-c":
        return []
    if args[i] == "-m":
        if i + 1 >= len(args):
            return [f"{shown}: -m without a module"]
        module, rest = args[i + 1], args[i + 2:]
        if not runnable_module(module):
            return [f"{shown}: no module {module} to run"]
        if module == "mlx_spec":
            return check_mlx_spec_args(rest)
        return []
    if not (ROOT / args[i]).is_file():
        return [f"{shown}: no file {args[i]}"]
    return []


def check_command(tokens: list) -> list:
    """Problems with one simple command (a list of words)."""
    tokens = list(tokens)
    while tokens and ENV_ASSIGNMENT.match(tokens[0]):
        tokens.pop(0)
    while tokens and tokens[0] in WRAPPERS:
        takes_value = WRAPPERS[tokens.pop(0)]
        while tokens and (tokens[0].startswith("-") or ENV_ASSIGNMENT.match(tokens[0])):
            option = tokens.pop(0)
            if option in takes_value and tokens:
                tokens.pop(0)
        if tokens and tokens[0].rstrip("smhd").replace(".", "").isdigit():  # timeout's duration
            tokens.pop(0)
    if not tokens:
        return []
    shown, program, args = " ".join(tokens), Path(tokens[0]).name, tokens[1:]
    if program == "mlx-spec":
        return check_mlx_spec_args(args)
    if PYTHON_NAME.match(program):
        return check_python_command(args, shown)
    if program == "make":
        targets = [a for a in args if not a.startswith("-") and "=" not in a]
        missing = [t for t in targets if t not in makefile_targets()]
        return [f"{shown}: no Makefile target {t}" for t in missing]
    if program == "bash" and args and not args[0].startswith("-"):
        return [] if (ROOT / args[0]).is_file() else [f"{shown}: no file {args[0]}"]
    if program == "mlx.launch":
        if "--" not in args:
            return [f"{shown}: mlx.launch without `--` before the command"]
        return check_command(args[args.index("--") + 1:])
    if program in ALLOWED_PROGRAMS:
        return []
    return [f"{shown}: unknown program {program!r} (not on the docs test's allow-list)"]


def check_shell_block(lang: str, body: str, where: str = "") -> list:
    problems = []
    for line in command_lines(lang, body):
        try:
            commands = split_commands(line)
        except ValueError as exc:
            problems.append(f"{where}: {line}: {exc}")
            continue
        for tokens in commands:
            problems += [f"{where}: {p}" for p in check_command(tokens)]
    return problems


def check_page(page: Path) -> list:
    text = page.read_text()
    problems = check_links(page)
    for lang, body, line in fenced_blocks(text):
        where = f"{page.relative_to(ROOT)}:{line}"
        if lang == "python":
            problems += check_python(body, where)
        elif lang in SHELL_LANGS:
            problems += check_shell_block(lang, body, where)
    return problems


# ------------------------------------------------------------------- tests


def test_there_are_docs():
    names = {p.name for p in PAGES}
    assert "README.md" in names and len(PAGES) > 1, names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page(page):
    problems = check_page(page)
    assert not problems, "\n".join(problems)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep it to {README_MAX_LINES}"


def test_docs_pages_are_linked_from_the_readme_or_the_index():
    linked = set()
    for page in (ROOT / "README.md", ROOT / "docs" / "README.md"):
        if page.exists():
            linked |= {(page.parent / t.partition("#")[0]).resolve()
                       for t in LINK.findall(prose(page.read_text())) if not t.startswith(("http", "#"))}
    orphans = [p.name for p in PAGES[1:] if p.resolve() not in linked and p.name != "README.md"]
    assert not orphans, f"docs pages no one links to: {orphans}"


def test_checkers_report_bad_links(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading\n")
    page.write_text("# Top\n[ok](there.md) [ok](there.md#a-heading) [ok](#top) [web](https://x.y/z)\n"
                    "[gone](missing.md) [bad anchor](there.md#nowhere) [self](#nowhere-here)\n"
                    "`[in code](not-checked.md)`\n")
    problems = check_links(page)
    assert len(problems) == 3, problems
    assert any("missing.md" in p for p in problems)
    assert any("#nowhere" in p and "there.md" in p for p in problems)
    assert any("#nowhere-here" in p for p in problems)


def test_checkers_report_bad_commands():
    bad = {
        "mlx-spec generate --no-such-flag": "no-such-flag",
        "mlx-spec generate --temp hot": "--temp",
        "mlx-spec frobnicate": "frobnicate",
        "LD_PRELOAD=/x.so python -m mlx_spec.no_such_module --quick": "no_such_module",
        "python -m training.no_such_stage": "training.no_such_stage",
        "python -m bench.studies.no_such_study --quick": "bench.studies.no_such_study",
        "python examples/no_such_example.py": "no_such_example",
        "make no-such-target": "no-such-target",
        "bash .ci/no-such-script": "no-such-script",
        "mlx.launch -n 2 -- mlx-spec generate --bogus": "bogus",
        "mlx-spec-typo generate": "unknown program",
        "echo hi | mlx-spec check --samples 5": "--samples",
    }
    for line, expected in bad.items():
        problems = check_shell_block("bash", line)
        assert problems and expected in problems[0], (line, problems)
    good = ("mlx-spec --help\nmlx-spec generate -h\n.venv/bin/mlx-spec tune --print  # a comment\n"
            "LD_PRELOAD=/usr/lib/x.so nice -n 10 python -m pytest -m soak tests\n"
            "mlx-spec generate --model M \\\n    --draft-model D --prompt 'Write a haiku'\n"
            "make run && make test\npython -m mlx_spec generate --no-draft\n")
    assert check_shell_block("bash", good) == []
    assert check_shell_block("console", "$ mlx-spec --version\nmlx-spec, version 0.1.0\n") == []
    assert check_shell_block("console", "$ mlx-spec --nope\n")


def test_checkers_report_bad_python():
    assert check_python("x = (1,\n", "snippet")
    assert check_python("from mlx_spec.no_such_module import x\n")
    assert check_python("from mlx_spec import no_such_name\n")
    assert check_python("import training.no_such_stage\n")
    assert check_python("from mlx_spec import load, generate\nfrom mlx_lm import load as l\n") == []


def test_fenced_blocks_and_prose():
    text = "a\n  ```python\n  x = 1\n  ```\n[l](x.md) `[c](y.md)`\n```bash\nmake run\n```\n"
    assert fenced_blocks(text) == [("python", "x = 1", 2), ("bash", "make run", 6)]
    assert LINK.findall(prose(text)) == ["x.md"]
    assert slug("Reusing a prompt cache across turns") == "reusing-a-prompt-cache-across-turns"
    assert slug("`mlx-spec tune`: calibration") == "mlx-spec-tune-calibration"
