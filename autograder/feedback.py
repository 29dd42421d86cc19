"""What students and instructors read: the per-student feedback page and the class summary.

The feedback page is written here, not by nbconvert, so that it shows exactly what it should:
each test with its points and the message that teaches, the student's own code with its
output, and the *visible* part of each test. Hidden tests, the referee's cells and receipts
never appear; lines of a hidden test that the student's code printed are blanked. Outputs are
shown as text and images only: HTML or JavaScript from a student's output never reaches a
browser.
"""

from __future__ import annotations

import html
import re
from collections import Counter
from typing import Any

CSS = """
body{font:15px/1.45 system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}
table{border-collapse:collapse;margin:1rem 0}td,th{border:1px solid #ccc;padding:.3rem .6rem;
text-align:left;vertical-align:top}th{background:#f3f3f3}.pass{color:#176f2c}.fail{color:#a4161a}
pre{background:#f7f7f7;padding:.6rem;overflow-x:auto;white-space:pre-wrap;margin:.3rem 0}
pre.out{background:#fff;border-left:3px solid #ccc}pre.err{background:#fff3f3;border-left:3px solid
#a4161a}.cell{margin:1.2rem 0}.label{font-size:12px;color:#666}.note{background:#fff8e1;padding:.5rem}
.bar{display:inline-block;height:.7rem;background:#a4161a}.barok{display:inline-block;height:.7rem;
background:#176f2c}
"""
MAX_SHOWN = 20_000  # characters of one output shown


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


_MATH = re.compile(r'<span class="math">\\\((.*?)\\\)</span>|<div class="math">\$\$(.*?)\$\$</div>', re.S)


def _mathml(match: re.Match[str]) -> str:
    """One formula of the lab's markdown as MathML, rendered by the browser itself: the page
    needs no script and no network (an exam room, a cluster), and no page view reaches a third
    party. A formula the converter cannot read stays as its TeX, in a code span."""
    inline, block = match.group(1), match.group(2)
    tex = html.unescape(inline if inline is not None else block).strip()
    try:
        from latex2mathml.converter import convert

        return convert(tex, display="inline" if inline is not None else "block")
    except Exception:
        return f"<code>{_e(tex)}</code>"


def _markdown(text: str) -> str:
    """The lab's own markdown as HTML: headings, tables, code, and the formulas (``$...$``,
    ``$$...$$``) as MathML. Only the lab's markdown, from the source (trusted: its HTML
    badge stays a badge); student markdown is never rendered. mistune comes with nbconvert."""
    try:
        import mistune

        render = mistune.create_markdown(escape=False,
                                         plugins=["table", "math", "strikethrough"])
        return _MATH.sub(_mathml, str(render(text)))
    except Exception:  # mistune missing or broken: plain text is fine
        return f"<pre>{_e(text)}</pre>"


def redact(text: str, secrets: set[str]) -> str:
    """Blank every line of ``text`` that contains a line of a hidden test."""
    if not secrets:
        return text
    out = []
    for line in text.split("\n"):
        out.append("[hidden test text removed]" if any(s in line for s in secrets) else line)
    return "\n".join(out)


def hidden_lines(hidden_sources: list[str]) -> set[str]:
    """The lines of hidden tests worth hiding (long enough to be specific)."""
    found = set()
    for src in hidden_sources:
        for line in src.split("\n"):
            s = line.strip()
            if len(s) >= 16 and not s.startswith("#"):
                found.add(s)
    return found


def _outputs(outputs: list[dict[str, Any]], secrets: set[str]) -> str:
    parts = []
    for out in outputs:
        kind = out.get("output_type")
        if kind == "stream":
            text = redact(str(out.get("text", "")), secrets)[:MAX_SHOWN]
            parts.append(f'<pre class="out">{_e(text)}</pre>')
        elif kind == "error":
            text = redact(f"{out.get('ename', '')}: {out.get('evalue', '')}", secrets)
            parts.append(f'<pre class="err">{_e(text[:MAX_SHOWN])}</pre>')
        elif kind in ("execute_result", "display_data"):
            data = out.get("data", {})
            png = data.get("image/png")
            if isinstance(png, str) and re.fullmatch(r"[A-Za-z0-9+/=\s]+", png):
                parts.append(f'<img alt="figure" src="data:image/png;base64,{png.strip()}">')
            elif "text/plain" in data:
                text = data["text/plain"]
                text = "".join(text) if isinstance(text, list) else str(text)
                parts.append(f'<pre class="out">{_e(redact(text, secrets)[:MAX_SHOWN])}</pre>')
    return "\n".join(parts)


def feedback_html(result: dict[str, Any], cells: list[dict[str, Any]],
                  groups: dict[str, float], secrets: set[str]) -> str:
    """One student's page for one lab. ``cells``: dicts with kind, role, grade_id, show,
    outputs (receipts already stripped)."""
    scores, messages, points = result["scores"], result["messages"], result["points"]
    got = result["groups"]
    rows = []
    for gid, pts in points.items():
        s = scores.get(gid, 0.0)
        msg = messages.get(gid, "")
        verdict = '<span class="pass">passed</span>' if s == pts and not msg else \
            f'<span class="fail">failed</span><br><pre class="err">{_e(redact(msg, secrets))}</pre>'
        rows.append(f"<tr><td>{_e(result['group_of'][gid])}</td><td>{_e(gid)}</td>"
                    f"<td>{s:g} / {pts:g}</td><td>{verdict}</td></tr>")
    head = [f"<h1>{_e(result['lab'])} — feedback for {_e(result['student'])}</h1>",
            f"<p><b>{result['total']:g} / {result['max_score']:g} points</b> "
            f"({_e(result['status'])})</p>"]
    if result.get("reason"):
        head.append(f'<p class="note">{_e(result["reason"])}</p>')
    if result.get("notes"):
        head.append('<p class="note">What the grader did with your notebook:<br>'
                    + "<br>".join(_e(n) for n in result["notes"]) + "</p>")
    summary = "".join(f"<tr><td>{_e(g)}</td><td>{got.get(g, 0):g} / {p:g}</td></tr>"
                      for g, p in groups.items())
    body = [*head, "<h2>Points per task</h2><table><tr><th>task</th><th>points</th></tr>",
            summary, "</table>", "<h2>Tests</h2>",
            "<table><tr><th>task</th><th>test</th><th>points</th><th>result</th></tr>",
            *rows, "</table>", "<h2>Your notebook, as graded</h2>",
            "<p class=label>The lab's cells in the lab's order; each test shows its visible "
            "part (hidden tests are not shown).</p>"]
    for c in cells:
        if c["kind"] == "markdown":
            body.append(f'<div class="cell">{_markdown(c["show"])}</div>')
            continue
        label = {"test": "test", "quiz": "quiz test", "setup": "setup (locked)",
                 "locked": "locked", "student": "your code"}.get(c["role"], c["role"])
        gid = f" · {c['grade_id']}" if c.get("grade_id") else ""
        body.append(f'<div class="cell"><div class="label">{_e(label)}{_e(gid)}</div>'
                    f'<pre>{_e(c["show"])}</pre>{_outputs(c["outputs"], secrets)}</div>')
    page = "\n".join(body)
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<title>{_e(result['lab'])}: {_e(result['student'])}</title><style>{CSS}</style>"
            "</head><body>" + page + "</body></html>\n")


# ---------------------------------------------------------------------------------------
# the class summary
# ---------------------------------------------------------------------------------------
_VOLATILE = [(re.compile(r"/tmp/[\w./-]+"), "<tmp path>"), (re.compile(r"0x[0-9a-f]{6,}"), "0x…"),
             (re.compile(r"\d+\.\d{3,}"), "<number>")]


def normalize_message(message: str) -> str:
    """The first line of a failure, without what varies between runs (paths, addresses)."""
    first = message.strip().split("\n")[0][:200]
    for pattern, repl in _VOLATILE:
        first = pattern.sub(repl, first)
    return first


_NUMBER = re.compile(r"(?<![\w.])\d+(?![\w.])")


def _kind(message: str) -> str:
    """One failure however many of a test's drawn inputs it hit (labkit.drawn: "11 of 117
    leaves" for one student, "10 of 117" for the next): its numbers that stand alone masked;
    those in a name (Q11, int16) kept."""
    return _NUMBER.sub("#", message)


def class_summary(results: list[dict[str, Any]], cells: dict[str, float], groups: dict[str, float],
                  group_of: dict[str, str], questions: dict[str, str]) -> list[dict[str, Any]]:
    """One row per task (group) and per graded cell, across the class: how many submissions
    earned full marks, none, the mean, and the most common failure. Sorted as the lab is."""
    graded = [r for r in results if r["status"] != "error"]
    n = len(graded)
    rows = []
    for g, pts in groups.items():
        rows.append(_row("task" if g != "quiz" else "quiz", g, g, pts,
                         [r["groups"][g] for r in graded], [], n))
    for gid, pts in cells.items():
        got = [r["scores"].get(gid, 0.0) for r in graded]
        msgs = [normalize_message(r["messages"].get(gid, "")) for r in graded
                if r["scores"].get(gid, 0.0) < pts and r["messages"].get(gid)]
        title = questions.get(gid, "")
        rows.append(_row("question" if group_of[gid] == "quiz" else "test", gid, group_of[gid],
                         pts, got, msgs, n, title))
    return rows


def _row(kind: str, name: str, group: str, pts: float, got: list[float], msgs: list[str],
         n: int, title: str = "") -> dict[str, Any]:
    full = sum(1 for x in got if x >= pts)
    zero = sum(1 for x in got if x == 0)
    common = ""
    if msgs:
        kinds = Counter(_kind(m) for m in msgs)
        top = max(kinds.values())
        common = f"{min(m for m in msgs if kinds[_kind(m)] == top)} ({top}×)"
    return {"kind": kind, "name": name, "task": group, "title": title, "points": pts,
            "submissions": n, "full_marks": full, "zero": zero,
            "mean": (sum(got) / n) if n else 0.0,
            "pct_full": (100.0 * full / n) if n else 0.0, "most_common_failure": common}


def summary_text(lab: str, rows: list[dict[str, Any]]) -> str:
    """The terminal's class summary: tasks and questions, hardest first."""
    lines = [f"class summary, {lab}: what most students failed (hardest first)"]
    items = sorted((r for r in rows if r["kind"] in ("task", "question")),
                   key=lambda r: (r["pct_full"], r["name"]))
    for r in items:
        what = f"task {r['name']}" if r["kind"] == "task" else (r["title"] or r["name"])
        lines.append(f"  {r['pct_full']:5.1f}% full marks  mean {r['mean']:.2f}/{r['points']:g}"
                     f"  {what}")
    worst = [r for r in sorted(rows, key=lambda r: (r["pct_full"], r["name"]))
             if r["kind"] in ("test", "question") and r["most_common_failure"]][:3]
    for r in worst:
        lines.append(f"  most common failure in {r['name']}: {r['most_common_failure']}")
    return "\n".join(lines) + "\n"


def summary_html(per_lab: dict[str, list[dict[str, Any]]]) -> str:
    body = ["<h1>Class summary</h1>"]
    for lab, rows in per_lab.items():
        body.append(f"<h2>{_e(lab)}</h2><table><tr><th></th><th>task</th><th>points</th>"
                    "<th>full marks</th><th>none</th><th>mean</th><th>most common failure</th></tr>")
        for r in rows:
            bar = (f'<span class="barok" style="width:{r["pct_full"] * 0.8:.0f}px"></span>'
                   f'<span class="bar" style="width:{(100 - r["pct_full"]) * 0.8:.0f}px"></span>')
            name = r["name"] if not r["title"] else f"{r['name']}: {r['title']}"
            style = ' style="font-weight:bold"' if r["kind"] in ("task", "quiz") else ""
            body.append(f"<tr{style}><td>{_e(r['kind'])}</td><td>{_e(name)}</td>"
                        f"<td>{r['points']:g}</td><td>{bar} {r['full_marks']}/{r['submissions']}"
                        f"</td><td>{r['zero']}</td><td>{r['mean']:.2f}</td>"
                        f"<td>{_e(r['most_common_failure'])}</td></tr>")
        body.append("</table>")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>Class summary</title>"
            f"<style>{CSS}</style></head><body>" + "\n".join(body) + "</body></html>\n")


# ---------------------------------------------------------------------------------------
# what the grader learned after the kernel: the hand-in, the instructor's overrides
# ---------------------------------------------------------------------------------------
ANNOTATION_BEGIN, ANNOTATION_END = "<!-- minickpt:after-grading -->", "<!-- /minickpt:after-grading -->"
_ANNOTATION = re.compile(re.escape(ANNOTATION_BEGIN) + ".*?" + re.escape(ANNOTATION_END) + "\n?",
                         re.S)


def annotate(page: str, result: dict[str, Any]) -> str:
    """``page`` with one block after its heading, made afresh from ``result``: the hand-in's
    notes (late, the resubmissions it superseded, what was repaired) and the instructor's
    overrides (the grader's points, the instructor's, the comment, the total after them).
    A block from an earlier write is replaced, so a page rewritten from the same result is the
    same bytes, and an override added or removed later shows at the next write."""
    page = _ANNOTATION.sub("", page)
    parts = []
    if result.get("intake"):
        parts.append('<p class="note">About your hand-in:<br>'
                     + "<br>".join(_e(n) for n in result["intake"]) + "</p>")
    if result.get("overrides"):
        rows = "".join(f"<tr><td>{_e(o['test'])}</td><td>{o['graded']:g}</td>"
                       f"<td>{o['points']:g}</td><td>{_e(o['comment'])}</td></tr>"
                       for o in result["overrides"])
        parts.append("<h2>Points set by your instructor</h2><table><tr><th>test</th>"
                     "<th>the grader's points</th><th>your instructor's</th><th>why</th></tr>"
                     f"{rows}</table><p><b>{result['total']:g} / {result['max_score']:g} points"
                     "</b> after these changes.</p>")
    if not parts:
        return page
    block = ANNOTATION_BEGIN + "".join(parts) + ANNOTATION_END + "\n"
    at = page.find("</h1>")
    if at < 0:
        return page + block
    at += len("</h1>")
    return page[:at] + "\n" + block + page[at:].lstrip("\n")
