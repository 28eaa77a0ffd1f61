"""The one-page summary of `./run_tests.sh --gpu --report DIR` (harness/gpu_report.py), as a pure function of the
logs the report wrote: a table of the steps (test files with pytest's counts, seconds against each step's limit), the
bench's runs, and the dry run's prediction (device and host peaks, step time) against a measured step.

Why from the log texts alone: a log is what a user brings back from an air-gapped node, and the same text must give
the same table here (tests/test_gpu_report.py reads canned logs: pytest's closing line, a timeout, a crash with no
closing line, a bench log). Each log carries the runner's header and footer lines (HEADER and FOOTER below) around
the command's own output, so a log says what ran, under which limit, and how it ended.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

HEADER = "gpu_report: step {name} ({kind}), limit {limit:.0f} s: {command}"
FOOTER_EXIT = "gpu_report: exit {rc} after {seconds:.1f} s"
FOOTER_KILLED = "gpu_report: killed at the {limit:.0f} s limit after {seconds:.1f} s"
FIGURES = "gpu_report figures: "
"""Prefix of the JSON line a measured step prints (the dry run's prediction and the GPU's measurement) and the
compiled-op step's."""
BENCH_ROW = "bench_gpu row: "
"""Prefix of one bench run's JSON line (bench/bench_gpu_report.py): printed as the run ends, so a cut step keeps it."""
BENCH_NOT_RUN = "bench_gpu not run: "
"""Prefix of a bench run left out because its estimate did not fit the time left (JSON: seq, side, estimate_s,
left_s)."""

_HEADER = re.compile(r"^gpu_report: step (?P<name>\S+) \((?P<kind>\w+)\), limit (?P<limit>[\d.]+) s: ", re.M)
_EXIT = re.compile(r"^gpu_report: exit (?P<rc>-?\d+) after (?P<seconds>[\d.]+) s", re.M)
_KILLED = re.compile(r"^gpu_report: killed at the (?P<limit>[\d.]+) s limit after (?P<seconds>[\d.]+) s", re.M)
_CLOSING = re.compile(r"^=*\s*(?P<body>(?:\d+ \w+(?:, )?)+|no tests ran) in (?P<seconds>[\d.]+)s\b.*$", re.M)
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)")
_PYTEST_TIMEOUT = re.compile(r"\+{5,} Timeout \+{5,}")
_TEST_FRAME = re.compile(r'File "[^"]*", line \d+, in (test_\w+)')
_BENCH_FIGURE = ("|", "Llama dim", "ring at CP=1", "ours / ", "TorchTitan", "transformers", "bench_gpu:")


@dataclass
class StepResult:
    name: str
    kind: str
    result: str
    seconds: float | None
    limit: float | None
    counts: dict
    ok: bool


def _last_error(text: str) -> str:
    """The last line that names an error (else the last line of output), shortened for a table cell."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("gpu_report")]
    errors = [line for line in lines if "Error" in line or "error:" in line or "Fatal" in line]
    return (errors or lines or ["no output"])[-1][-160:].replace("|", "/")


def _pytest_result(text: str, killed: bool, rc: int | None) -> tuple[str, dict, bool]:
    closing = list(_CLOSING.finditer(text))
    counts: dict = {}
    if closing:
        for number, word in _COUNT.findall(closing[-1].group("body")):
            word = "errors" if word.startswith("error") else word
            counts[word] = counts.get(word, 0) + int(number)
    if _PYTEST_TIMEOUT.search(text):
        frames = _TEST_FRAME.findall(text)
        where = f" in {frames[-1]}" if frames else ""
        return f"timed out{where}: a test passed its pytest-timeout limit (stacks in the log)", counts, False
    if killed:
        return "timed out: the file passed its limit", counts, False
    if not closing:
        signal = f" (signal {-rc})" if rc is not None and rc < 0 else ""
        return f"crashed{signal}, no closing line: {_last_error(text)}", counts, False
    if counts.get("failed") or counts.get("errors"):
        return "FAILED", counts, False
    if counts.get("passed"):
        return "passed", counts, True
    if counts.get("skipped"):
        return "skipped", counts, True
    return "no GPU tests in it", counts, rc in (0, 5)


def _wheels_result(text: str, killed: bool, rc: int | None) -> tuple[str, bool]:
    if killed:
        return "timed out", False
    if rc == 0:
        installed = re.findall(r"^Successfully installed (.*)$", text, re.M)
        return (f"installed {len(installed[-1].split())} wheel(s)" if installed else "already installed"), True
    hint = ""
    if "externally-managed" in text:
        hint = " (fix: a venv made with --system-site-packages, or PIP_BREAK_SYSTEM_PACKAGES=1)"
    return f"FAILED: {_last_error(text)}{hint}", False


def parse_step(text: str) -> StepResult:
    """One log -> its row."""
    header = _HEADER.search(text)
    name, kind = (header.group("name"), header.group("kind")) if header else ("?", "?")
    limit = float(header.group("limit")) if header else None
    ended, killed = _EXIT.search(text), _KILLED.search(text)
    seconds = float((killed or ended).group("seconds")) if (killed or ended) else None
    rc = int(ended.group("rc")) if ended else None
    counts: dict = {}
    if kind == "pytest":
        result, counts, ok = _pytest_result(text, bool(killed), rc)
    elif kind == "wheels":
        result, ok = _wheels_result(text, bool(killed), rc)
    elif killed:
        result, ok = "timed out", False
    elif rc == 0:
        result, ok = "ran", True
    else:
        result, ok = f"FAILED (exit {rc}): {_last_error(text)}", False
    return StepResult(name, kind, result, seconds, limit, counts, ok)


def bench_lines(text: str) -> list[str]:
    """The bench's figures: its markdown tables as they are, its one-line results and notes as a list."""
    out: list[str] = []
    for line in (line.rstrip() for line in text.splitlines() if line.startswith(_BENCH_FIGURE)):
        table = line.startswith("|")
        if out and out[-1].startswith("|") != table:
            out.append("")  # a table and a list each need their own block
        out.append(line if table else f"- {line}")
    return out


def _json_lines(text: str, prefix: str) -> list[dict]:
    return [json.loads(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix)]


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def bench_table(text: str) -> list[str]:
    """The bench's runs as one table, a row per run in the order they ran (a failed run says why in its tok/s cell),
    ours against the transformers loop at the same length in the last column; then the runs left out, and the
    bench's own one-line notes (TorchTitan's availability)."""
    rows, left_out = _json_lines(text, BENCH_ROW), _json_lines(text, BENCH_NOT_RUN)
    peers = {row["seq"]: row["tok_s"] for row in rows if row["side"] == "transformers" and "tok_s" in row}
    out = ["| tokens | system | tok/s | peak GiB | MFU, causal attention as half | MFU, attention in full | "
           "tok/s / transformers | run s |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            out.append(f"| {row['seq']:,} | {row['side']} | failed: {row['error'].replace('|', '/')} | | | | | |")
            continue
        ratio = f"{row['tok_s'] / peers[row['seq']]:.3f}" if row["side"] != "transformers" and peers.get(
            row["seq"]) else "-"
        out.append(f"| {row['seq']:,} | {row['system']} | {row['tok_s']:,.0f} | {_cell(row['peak_gib'], '.2f')} | "
                   f"{row['mfu_causal']:.1%} | {row['mfu_full']:.1%} | {ratio} | {row['seconds']:.0f} |")
    out.append("")
    out += [f"- not run: {r['side']} at {r['seq']:,} tokens (estimated {r['estimate_s']:.0f} s, {r['left_s']:.0f} s "
            f"left of the bench's budget)" for r in left_out]
    out += [f"- {line}" for line in text.splitlines() if line.startswith("TorchTitan")]
    return out if rows or left_out else []


def step_figures(text: str) -> dict | None:
    lines = [line for line in text.splitlines() if line.startswith(FIGURES)]
    return json.loads(lines[-1][len(FIGURES):]) if lines else None


def _ratio(predicted: float, measured: float) -> str:
    """predicted / measured, the one direction of every report (bench_gpu, bench_predictions too)."""
    return f"{predicted / measured:.2f}" if predicted and measured else "-"


def prediction_table(figures: dict) -> list[str]:
    """A measured step (harness/gpu_measure_step.py): device peak, host peak (where the run logged one), the pinned
    host bytes of activation offload, and step time, predicted against measured."""
    band, steps = figures["predicted_step_s_band"], figures["steps"]
    measured = f"median of steps 2..{steps}" if steps > 1 else "its one step (warm-up included)"
    offload = ", training.cpu_offload" if figures.get("cpu_offload") else ""
    out = [f"{figures.get('recipe', 'debug.toml')}, {figures['shape']}{offload}; {figures['seq_len']:,} tokens, batch "
           f"1, bf16; measured: {measured} of train.py on this GPU; predicted: `--dry-run` for hardware.accelerator "
           f"= {figures['accelerator']}." + (f" Length: {figures['note']}." if figures.get("note") else ""), "",
           "| | predicted | measured | predicted / measured |", "|---|---|---|---|",
           f"| device peak, GiB | {figures['predicted_peak_gib']:.2f} | {figures['measured_peak_gib']:.2f} | "
           f"{_ratio(figures['predicted_peak_gib'], figures['measured_peak_gib'])} |"]
    for label, key in (("host peak (resident set), GiB", "host_gib"), ("pinned activation arena, GiB", "pinned_gib")):
        predicted, got = figures.get(f"predicted_{key}"), figures.get(f"measured_{key}")
        if predicted is not None and got is not None:
            out.append(f"| {label} | {predicted:.2f} | {got:.2f} | {_ratio(predicted, got)} |")
    step_s = (figures["predicted_step_s"], figures["measured_step_s"])
    out.append(f"| step time, s | {step_s[0]:.3f} (band {band[0]:.3f}..{band[1]:.3f}) | {step_s[1]:.3f} | "
               f"{_ratio(*step_s)} |")
    return out


def compiled_op_table(figures: dict) -> list[str]:
    """The compiled-op step's runs (harness/gpu_compiled_op.py): each against eager, with its compile counters."""
    out = [f"Shape: {figures['shape']}; {figures['seq_len']:,} tokens, batch 1, {figures['dtype']}, documents "
           f"masked at CP 1 ({figures['documents_kernel']}); {figures['steps']} steps; bound "
           f"{figures['bound']:.0e} relative per step against eager.", "",
           "| run | loss rel | grad norm rel | graphs | graph breaks | step 1 s | last step s | peak GiB |",
           "|---|---|---|---|---|---|---|---|"]
    for name, row in figures["runs"].items():
        rel = [f"{row[k]:.1e}" if k in row else "-" for k in ("loss_rel", "grad_norm_rel")]
        counters = [str(row.get(k, "-")) for k in ("graphs", "graph_breaks")]
        first = f"{row['first_step_s']:.1f}" if row.get("first_step_s") is not None else "-"
        out.append(f"| {name} | {' | '.join(rel)} | {' | '.join(counters)} | {first} | {row['step_s']:.3f} | "
                   f"{row['peak_gib']:.2f} |")
    return out


def summarize(logs: list[str], title: str = "") -> str:
    """The summary page (markdown) of the logs, in the order they ran."""
    rows = [parse_step(text) for text in logs]
    out = ["# GPU report", ""] + ([title, ""] if title else [])
    out += ["| step | result | passed | failed | skipped | seconds | limit s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        counts = [str(r.counts.get(k, 0)) if r.kind == "pytest" else "" for k in ("passed", "failed", "skipped")]
        if r.kind == "pytest" and r.counts.get("errors"):
            counts[1] += f" + {r.counts['errors']} error(s)"
        seconds = f"{r.seconds:.1f}" if r.seconds is not None else "-"
        limit = f"{r.limit:.0f}" if r.limit is not None else "-"
        out.append(f"| {r.name} | {r.result} | {' | '.join(counts)} | {seconds} | {limit} |")
    spent = sum(r.seconds or 0 for r in rows)
    limits = sum(r.limit or 0 for r in rows)
    bad = [r.name for r in rows if not r.ok]
    out += ["", f"{len(rows) - len(bad)} of {len(rows)} steps ok" + (f"; not ok: {', '.join(bad)}" if bad else "")
            + f". {spent:.0f} s spent of {limits:.0f} s of limits."]
    for text, r in zip(logs, rows):
        if r.kind == "bench":
            out += ["", f"## {r.name}", ""] + (bench_table(text) or bench_lines(text) or [f"no figures: {r.result}"])
        elif r.kind == "step":
            figures = step_figures(text)
            out += ["", f"## {r.name}: the dry run's prediction vs the GPU", ""]
            out += prediction_table(figures) if figures else [f"no figures: {r.result}"]
            out += [f"- {line}" for line in text.splitlines() if line.startswith("offload step: ")]
        elif r.kind == "compiled":
            figures = step_figures(text)
            out += ["", f"## {r.name}: compiled against eager", ""]
            out += compiled_op_table(figures) if figures else [f"no figures: {r.result}"]
            out += [f"- {line}" for line in text.splitlines() if line.startswith("compiled op: ")]
    return "\n".join(out) + "\n"


def all_ok(logs: list[str]) -> bool:
    return all(parse_step(text).ok for text in logs)
