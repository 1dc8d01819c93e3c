"""README's runnable Python examples, run as written with the test servers' addresses swapped in:
the quick start and the sharded cache print what README's comments say they print. And README's
table of server flags against the server's --help."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def python_block(first_line: str) -> str:
    """The ```python block of README that starts with first_line."""
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)
    found = [b for b in blocks if b.startswith(first_line)]
    assert len(found) == 1, f"README has {len(found)} python blocks starting {first_line!r}"
    return found[0]


def documented_prints(code: str) -> list[str]:
    """What README's comments say each print() of a block prints, in order."""
    return [m.group(1).strip() for m in re.finditer(r"^\s*print\(.*\)\s+#\s*(.*)$", code, re.M)]


def run_block(code: str, namespace: dict) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), namespace)
    return out.getvalue().splitlines()


def quick_start(target: str) -> tuple[list[str], list[str], dict]:
    code = python_block("import numpy as np\nimport pagedattn\n")
    namespace: dict = {}
    printed = run_block(code.replace('"localhost:50051"', repr(target)), namespace)
    return printed, documented_prints(code), namespace


def test_quick_start_prints_what_readme_says(target):
    printed, documented, _ = quick_start(target)
    assert documented, "README's quick start documents no print"
    assert printed == documented


def test_step_example_runs_in_the_quick_start(target):
    # README places it in the quick start's `with` block, after the decode of layer 0.
    code = python_block("import numpy as np\nimport pagedattn\n")
    step = python_block("with cache.step(")
    last = code.rstrip("\n").splitlines()[-1]
    assert last.startswith("        print(out.shape")
    code = code.rstrip("\n") + "\n" + "".join(f"        {line}\n" for line in step.splitlines())
    printed = run_block(code.replace('"localhost:50051"', repr(target)), {})
    assert printed[0] == "(1, 32, 128) float32"
    assert re.fullmatch(r"Timing\(server_micros=\d+, kernel_micros=\d+\)", printed[1]), printed


def test_sharded_example_prints_what_readme_says(target, shard_servers):
    # The sharded example uses the quick start's qkv helper, as README's reader has it.
    _, _, namespace = quick_start(target)
    code = python_block("targets = ")
    targets = [s.target for s in shard_servers[:2]]
    runnable, n = re.subn(r"^targets = \[.*?\]", f"targets = {targets!r}", code, flags=re.M)
    assert n == 1
    documented = documented_prints(code)
    assert documented, "README's sharded example documents no print"
    assert run_block(runnable, namespace) == documented


def test_asyncio_example_prints_what_readme_says(target):
    # The asyncio example uses the quick start's config and qkv helper, as README's reader has them.
    _, _, namespace = quick_start(target)
    code = python_block("import asyncio\nimport pagedattn.aio\n")
    documented = documented_prints(code)
    assert documented, "README's asyncio example documents no print"
    assert run_block(code.replace('"localhost:50051"', repr(target)), namespace) == documented


def test_package_docstring_example_runs(target):
    """`help(pagedattn)`'s example, run as written (it decoded a layer it had not prefilled)."""
    import numpy as np

    import pagedattn

    code = "\n".join(line[4:] for line in pagedattn.__doc__.split("\n\n")[1].splitlines())
    namespace: dict = {}
    exec(compile(code.replace('"localhost:50051"', repr(target)), "pagedattn.__doc__", "exec"),
         namespace)
    assert [o.shape for o in namespace["outs"]] == [(1, 8, 64), (1, 8, 64)]
    assert all(np.isfinite(o).all() for o in namespace["outs"])


def test_server_flag_table_matches_help(server_binary):
    # Every flag --help lists is in README's table of server flags, with --help's default.
    help_text = subprocess.run([server_binary, "--help"], capture_output=True, text=True,
                               check=True).stdout
    defaults = dict(re.findall(r"^  --(\w+) \(default: (.*)\)$", help_text, re.M))
    assert "listen" in defaults and "unix_socket_mode" in defaults, help_text
    section = README.read_text().split("\n## pagedattn-server flags\n", 1)[1].split("\n## ", 1)[0]
    table: dict[str, str] = {}
    for row in re.findall(r"^\| (`--.*?) \| (.*?) \|", section, re.M):
        flags = re.findall(r"`--(\w+)`", row[0])
        # One default for every flag of the row, or one each; "unset" is an empty value.
        values = [re.sub(r" \(.*\)$", "", v.strip("` ")) for v in row[1].split(", ")]
        values = ["" if v == "unset" else v for v in values]
        assert len(values) in (1, len(flags)), row
        for flag, value in zip(flags, values * len(flags) if len(values) == 1 else values):
            table[flag] = value
    missing, extra = sorted(set(defaults) - set(table)), sorted(set(table) - set(defaults))
    assert (missing, extra) == ([], []), "flags of --help not in README's table, and the reverse"
    assert table == defaults


def test_example_without_torch_says_what_to_install():
    """README's transformers example on a Python without torch: one line saying what to install,
    not a traceback (torch hidden here: sys.modules["torch"] = None fails its import)."""
    example = README.parent / "examples" / "transformers_generate.py"
    hide_torch = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = [sys.argv[1]]; "
                  "runpy.run_path(sys.argv[0], run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", hide_torch, str(example)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "needs torch and transformers: pip install ./client/python torch transformers" in r.stderr
