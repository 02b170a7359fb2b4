"""Math answer extraction and equivalence (MATH-500, AIME), re-implemented from the published harnesses' graders.

Pipeline (after Qwen2.5-Math's `extract_answer` + `math_equal`, which the R-KV and TriAttention tables use):
1. extraction: the content of the last \\boxed{...} (brace-matched; \\fbox too), else "the answer is ...",
   else the last number; only the text after </think> when there is one;
2. normalisation: spaces, \\left/\\right, \\dfrac/\\tfrac, \\text{...} units and wrappers, degrees, dollars,
   percent, "x =" prefixes, thousands separators, trailing dots;
3. equality, first match wins: normalised strings (case-insensitive); numbers within rel. 1e-4; element-wise
   for tuples, intervals (bracket types must match) and lists; "a = b" equations as a - b; finally sympy:
   both sides converted from LaTeX to sympy (own converter, no ANTLR), equal when simplify(a - b) == 0 or
   their numeric values agree. Sympy runs in a forked process with a timeout (default 3 s, as TriAttention's
   harness); a timeout counts as "not equal".
"""

from __future__ import annotations

import math
import multiprocessing
import re

# ---- extraction -------------------------------------------------------------------------------------------


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} (brace-matched), or None."""
    index = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if index < 0:
        return None
    i = index + (6 if text.startswith("\\boxed", index) else 5)
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] != "{":  # "\boxed 5"
        match = re.match(r"\s*([^\s$]+)", text[i:])
        return match.group(1) if match else None
    depth, start = 0, i
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : j]
    return None


def extract_answer(text: str) -> str:
    """The model's final answer: last \\boxed{}, else "the answer is X", else the last number ("" if none)."""
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    match = re.findall(r"answer is[:\s]*\$?([^\n$]+?)\$?(?:\.\s|\.?$|\n)", text, flags=re.IGNORECASE)
    if match:
        return match[-1].strip()
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?", text)
    return numbers[-1].replace(",", "") if numbers else ""


# ---- normalisation --------------------------------------------------------------------------------------
_UNITS = (
    "degrees?", "cm", "centimeters?", "meters?", "m", "km", "kilometers?", "inches?", "inch", "feet", "foot", "ft",
    "units?", "square units", "sq units", "dollars?", "cents?", "hours?", "minutes?", "seconds?", "days?", "weeks?",
    "years?", "miles?", "mph", "pounds?", "ounces?", "grams?", "kg", "liters?", "mm", "people", "students?",
)
_UNIT_RE = re.compile(r"(?<=[\d}\)])\s*(?:\\(?:text|mbox|mathrm)\{\s*)?(?:" + "|".join(_UNITS) + r")\}?(?:\^\{?[23]\}?)?\s*$")


def _fix_fracs(s: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{2} -> \\frac{1}{2}, \\sqrt2 -> \\sqrt{2}."""
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\s*(\d)\s*\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\s*\{([^{}]*)\}\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt\s*(\d+|[a-zA-Z])", r"\\sqrt{\1}", s)
    return s


def normalize(answer: str) -> str:
    s = str(answer).strip()
    s = s.replace("\n", "").replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\ ", "").replace("~", "")
    s = s.replace("\\displaystyle", "")
    s = re.sub(r"\\(?:left|right)\b\s*", "", s)
    s = s.replace("dfrac", "frac").replace("tfrac", "frac")
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\circ", "").replace("°", "")
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\%", "%")
    s = _UNIT_RE.sub("", s)
    s = re.sub(r"\\(?:text|textbf|mathrm|mathbf|mbox)\{([^{}]*)\}", r"\1", s)
    s = s.strip()
    if s.count("=") == 1 and re.fullmatch(r"\\?[a-zA-Z]{1,2}(?:\([a-z]\))?", s.split("=")[0].strip()):
        s = s.split("=")[1].strip()  # "x = 5", "k=3", "f(x) = x^2" -> the right-hand side
    s = _fix_fracs(s)
    s = s.replace(" ", "")
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # thousands separators
        s = s.replace(",", "")
    if re.fullmatch(r"-?0*\d+", s):  # integers: drop leading zeros (AIME "042")
        sign = "-" if s.startswith("-") else ""
        s = sign + (s.lstrip("-").lstrip("0") or "0")
    return s


# ---- numbers ---------------------------------------------------------------------------------------------
def _to_number(s: str) -> float | None:
    s = s.replace("%", "")
    match = re.fullmatch(r"(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}", s)
    if match:
        value = float(match.group(2)) / float(match.group(3))
        return -value if match.group(1) else value
    match = re.fullmatch(r"(-?\d+(?:\.\d+)?)/(\d+(?:\.\d+)?)", s)
    if match:
        return float(match.group(1)) / float(match.group(2))
    try:
        return float(s)
    except ValueError:
        return None


def _numbers_equal(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-8)


# ---- LaTeX -> sympy ---------------------------------------------------------------------------------------
def _replace_command_args(s: str, command: str, n_args: int, build) -> str:
    """Replace \\command{a}{b} (brace-matched arguments) by build(a, b)."""
    out = []
    i = 0
    while True:
        j = s.find(command, i)
        if j < 0:
            out.append(s[i:])
            return "".join(out)
        k = j + len(command)
        if k < len(s) and s[k].isalpha():  # a longer command name
            out.append(s[i:k])
            i = k
            continue
        args, pos = [], k
        for _ in range(n_args):
            while pos < len(s) and s[pos] == " ":
                pos += 1
            if pos < len(s) and s[pos] == "{":
                depth, start = 0, pos
                for q in range(pos, len(s)):
                    depth += s[q] == "{"
                    depth -= s[q] == "}"
                    if depth == 0:
                        break
                args.append(s[start + 1 : q])
                pos = q + 1
            elif pos < len(s):
                args.append(s[pos])
                pos += 1
        if len(args) < n_args:
            raise ValueError(f"malformed {command}")
        out.append(s[i:j])
        out.append(build(*args))
        i = pos


def latex_to_sympy_text(s: str) -> str:
    s = normalize(s) if "\\" in s or "$" in s else s
    s = s.replace("\\left", "").replace("\\right", "")
    s = re.sub(r"\\sqrt\[([^\]]+)\]\{([^{}]*)\}", r"((\2)**(1/(\1)))", s)
    for _ in range(5):
        if "\\frac" not in s and "\\sqrt" not in s and "\\binom" not in s:
            break
        s = _replace_command_args(s, "\\frac", 2, lambda a, b: f"(({a})/({b}))")
        s = _replace_command_args(s, "\\sqrt", 1, lambda a: f"sqrt({a})")
        s = _replace_command_args(s, "\\binom", 2, lambda a, b: f"binomial({a},{b})")
    replacements = {
        "\\cdot": "*", "\\times": "*", "\\div": "/", "\\pi": "pi", "\\infty": "oo", "\\ln": "log", "\\log": "log",
        "\\sin": "sin", "\\cos": "cos", "\\tan": "tan", "\\cot": "cot", "\\sec": "sec", "\\csc": "csc",
        "\\arcsin": "asin", "\\arccos": "acos", "\\arctan": "atan", "\\exp": "exp", "\\theta": "theta",
        "\\alpha": "alpha", "\\beta": "beta", "\\mathrm": "", "\\operatorname": "", "^": "**", "{": "(", "}": ")",
        "\\": "",
    }
    for key in sorted(replacements, key=len, reverse=True):
        s = s.replace(key, replacements[key])
    return s


def _sympy_parse(text: str):
    import sympy
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    local = {"i": sympy.I, "e": sympy.E, "pi": sympy.pi, "oo": sympy.oo, "E": sympy.E}
    transformations = standard_transformations + (implicit_multiplication_application, convert_xor)
    return parse_expr(latex_to_sympy_text(text), local_dict=local, transformations=transformations, evaluate=True)


def _sympy_equal(a: str, b: str) -> bool:
    import sympy

    x, y = _sympy_parse(a), _sympy_parse(b)
    if isinstance(x, sympy.Eq) or isinstance(y, sympy.Eq):
        x = x.lhs - x.rhs if isinstance(x, sympy.Eq) else x
        y = y.lhs - y.rhs if isinstance(y, sympy.Eq) else y
    try:
        if sympy.simplify(x - y) == 0:
            return True
    except (TypeError, ValueError, AttributeError):
        pass
    try:
        if x.free_symbols or y.free_symbols:
            return bool(x.equals(y))
        return _numbers_equal(complex(sympy.N(x)).real, complex(sympy.N(y)).real) and _numbers_equal(
            complex(sympy.N(x)).imag, complex(sympy.N(y)).imag)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return False


def _child(conn, fn, args):
    try:
        conn.send(("ok", fn(*args)))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        conn.send(("error", repr(error)))
    finally:
        conn.close()


def call_with_timeout(fn, args: tuple, timeout: float, default=False):
    """fn(*args) in a forked process, `default` on timeout or error (inline where fork is unavailable)."""
    if timeout is None or "fork" not in multiprocessing.get_all_start_methods():
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001
            return default
    context = multiprocessing.get_context("fork")
    parent, child = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(child, fn, args), daemon=True)
    process.start()
    child.close()
    try:
        if parent.poll(timeout):
            status, value = parent.recv()
            return value if status == "ok" else default
        return default
    except EOFError:
        return default
    finally:
        if process.is_alive():
            process.kill()
        process.join(1)
        parent.close()


# ---- equality ---------------------------------------------------------------------------------------------
_OPEN, _CLOSE = "([{", ")]}"


def _split_top_level(s: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return parts


def _wrapped(s: str) -> tuple[str, str, str] | None:
    """(open, inside, close) when the whole string is one bracketed group, e.g. (1,2) or [2,5)."""
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        depth = 0
        for index, ch in enumerate(s):
            depth += ch in "(["
            depth -= ch in ")]"
            if depth == 0 and index < len(s) - 1:
                return None
        return s[0], s[1:-1], s[-1]
    return None


def math_equal(prediction: str, reference: str, timeout: float | None = 3.0) -> bool:
    """True when the prediction is mathematically the reference answer (see the module docstring)."""
    if prediction is None or reference is None:
        return False
    a, b = normalize(prediction), normalize(reference)
    if not a or not b:
        return False
    if a.lower() == b.lower():
        return True
    x, y = _to_number(a), _to_number(b)
    if x is not None and y is not None:
        if _numbers_equal(x, y):
            return True
        if "%" in a or "%" in b:
            return _numbers_equal(x, y * 100) or _numbers_equal(x * 100, y)
        return False
    wa, wb = _wrapped(a), _wrapped(b)
    if wa and wb:
        pa, pb = _split_top_level(wa[1]), _split_top_level(wb[1])
        if len(pa) != len(pb):
            return False
        if len(pa) == 2 and (wa[0], wa[2]) != (wb[0], wb[2]):  # intervals: open/closed ends must match
            return False
        return all(math_equal(p, q, timeout) for p, q in zip(pa, pb))
    if (wa is None) != (wb is None) and ("," in a or "," in b):
        pa = _split_top_level(wa[1] if wa else a)
        pb = _split_top_level(wb[1] if wb else b)
        if len(pa) > 1 and len(pa) == len(pb):  # "1, 2" vs "(1, 2)"
            return all(math_equal(p, q, timeout) for p, q in zip(pa, pb))
        return False
    if "," in a and "," in b:
        pa, pb = _split_top_level(a), _split_top_level(b)
        if len(pa) > 1 or len(pb) > 1:  # commas inside brackets only ("f(1,2)") leave one part: compared whole below
            if len(pa) != len(pb):
                return False
            return all(math_equal(p, q, timeout) for p, q in zip(pa, pb))
    if re.fullmatch(r"[A-Za-z ]+", a) and re.fullmatch(r"[A-Za-z ]+", b) and len(a) > 2 and len(b) > 2:
        return False  # different words ("even" vs "odd")
    if x is not None and y is None and re.search(r"[a-zA-Z]", b.replace("\\frac", "").replace("\\sqrt", "").replace("\\pi", "").replace("pi", "")):
        return False  # a number is not an expression in letters
    import sympy  # noqa: F401  (imported before the fork, so the checking process starts warm)

    return bool(call_with_timeout(_sympy_equal, (a, b), timeout, default=False))
