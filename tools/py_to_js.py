"""Translate a few Python formula functions into JavaScript, so that a page computes with the
course's own formulas instead of a copy of them (tools/pages.py uses it).

    js = translate([predict, param_counts, ...], dataclasses=[Layout, ModelConfig])

Each function is read back from its source (inspect.getsource) and written out statement by
statement. Only a small subset of Python is understood, the one the formulas are written in:
assignments (also `a, b = x, y` and `d[k] = v`), `+=`, if/elif/else, for loops over tuples, lists
and dict.items()/values(), return, raise; numbers, strings, f-strings without format specs,
tuples, lists, dicts (also `**d` inside one), dict and list comprehensions and generator
expressions, conditional expressions, and/or/not, comparisons (`is None`, `in`), calls of the
translated functions (keyword arguments too), of the dataclasses given (keyword arguments, `**d`),
of dataclasses.replace, dict(...), max, min, sum, round (half to even, as Python's), abs, len, int
and float, and .items(), .values(), .keys(), .get(), .to_dict(). Module-level names a function
reads (constants such as GiB, or the presets) are written as JavaScript constants with their
current values. Anything else stops the translation with the file and line, instead of
translating it wrongly. Python's truth values differ from JavaScript's for empty lists and dicts:
the formulas test numbers, booleans and None only.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import textwrap

PRELUDE = """\
const py = {
  floordiv: (a, b) => Math.floor(a / b),
  mod: (a, b) => ((a % b) + b) % b,
  round: (x) => {  // Python's round(): halves go to the even neighbour
    const f = Math.floor(x), d = x - f;
    return d > 0.5 ? f + 1 : d < 0.5 ? f : (f % 2 === 0 ? f : f + 1);
  },
  sum: (xs) => xs.reduce((a, b) => a + b, 0),
  max: (...a) => (a.length === 1 ? Math.max(...a[0]) : Math.max(...a)),
  min: (...a) => (a.length === 1 ? Math.min(...a[0]) : Math.min(...a)),
  iter: (x) => (Array.isArray(x) ? x : Object.keys(x)),
  contains: (c, x) => (Array.isArray(c) ? c.includes(x) : x in c),
  get: (o, k, d) => (k in o ? o[k] : (d === undefined ? null : d)),
  len: (x) => (Array.isArray(x) ? x.length : Object.keys(x).length),
};
"""

BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**"}
COMPARE = {ast.Eq: "===", ast.NotEq: "!==", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">",
           ast.GtE: ">="}
BUILTINS = {"max": "py.max", "min": "py.min", "sum": "py.sum", "round": "py.round",
            "abs": "Math.abs", "len": "py.len", "int": "Math.trunc", "float": "Number"}


class Untranslatable(SyntaxError):
    pass


class Translator:
    def __init__(self, functions, dataclasses_=()):
        self.functions = {f.__name__: f for f in functions}
        self.signatures = {name: inspect.signature(f) for name, f in self.functions.items()}
        self.dataclasses = {c.__name__: c for c in dataclasses_}
        self.constants: dict[str, object] = {}
        self.where = ""

    # ------------------------------------------------------------------ the whole
    def translate(self) -> str:
        bodies = [self.function(f) for f in self.functions.values()]
        parts = [PRELUDE]
        for name, cls in self.dataclasses.items():
            defaults = {f.name: f.default for f in dataclasses.fields(cls)
                        if f.default is not dataclasses.MISSING}
            parts.append(f"function {name}(o) {{ return Object.assign({json.dumps(defaults)}, o); }}")
        for name, value in self.constants.items():
            parts.append(f"const {name} = {json.dumps(self.value(value))};")
        return "\n".join(parts + bodies) + "\n"

    def value(self, v):
        """A module constant as JSON: dataclasses as objects, tuples as lists."""
        if dataclasses.is_dataclass(v):
            return dataclasses.asdict(v)
        if isinstance(v, dict):
            return {k: self.value(x) for k, x in v.items()}
        if isinstance(v, (tuple, list)):
            return [self.value(x) for x in v]
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise Untranslatable(f"{self.where}: the constant {v!r} has no JSON form")

    def fail(self, node, what: str):
        raise Untranslatable(f"{self.where}:{getattr(node, 'lineno', '?')}: {what} "
                             f"({ast.unparse(node)[:60]!r}) is outside the subset tools/py_to_js.py "
                             "translates: write the formula with what its docstring lists")

    def function(self, fn) -> str:
        source = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(source).body[0]
        _, first_line = inspect.getsourcelines(fn)
        self.where = f"{inspect.getsourcefile(fn)}:{fn.__name__}"
        ast.increment_lineno(tree, first_line - 1)
        self.globals = fn.__globals__
        self.params = [a.arg for a in (*tree.args.args, *tree.args.kwonlyargs)]
        defaults = dict(zip([a.arg for a in tree.args.args][::-1], tree.args.defaults[::-1]))
        defaults.update({a.arg: d for a, d in zip(tree.args.kwonlyargs, tree.args.kw_defaults)
                         if d is not None})
        if tree.args.vararg or tree.args.kwarg:
            self.fail(tree, "*args or **kwargs")
        self.locals = set(self.params)
        assigned = sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
                           and isinstance(n.ctx, ast.Store) and not self.in_comprehension(tree, n)}
                          - set(self.params))
        self.locals |= set(assigned)
        self.locals |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
                        and isinstance(n.ctx, ast.Store) and self.in_comprehension(tree, n)}
        params = ", ".join(f"{p} = {self.expr(defaults[p])}" if p in defaults else p
                           for p in self.params)
        body = [f"  let {', '.join(assigned)};"] if assigned else []
        body += self.block(tree.body, "  ")
        return f"function {tree.name}({params}) {{\n" + "\n".join(body) + "\n}"

    @staticmethod
    def in_comprehension(tree, name) -> bool:
        for node in ast.walk(tree):
            if isinstance(node, (ast.ListComp, ast.DictComp, ast.GeneratorExp, ast.SetComp)):
                if any(name is n for g in node.generators for n in ast.walk(g.target)):
                    return True
        return False

    # ------------------------------------------------------------------ statements
    def block(self, statements, indent: str) -> list[str]:
        lines = []
        for s in statements:
            lines += self.statement(s, indent)
        return lines

    def statement(self, s, i: str) -> list[str]:
        if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str):
            return []  # a docstring
        if isinstance(s, ast.Return):
            return [f"{i}return {self.expr(s.value) if s.value else 'null'};"]
        if isinstance(s, ast.Assign):
            if len(s.targets) != 1:
                self.fail(s, "a chained assignment")
            return [f"{i}{self.target(s.targets[0])} = {self.expr(s.value)};"]
        if isinstance(s, ast.AugAssign) and type(s.op) in BINOPS:
            return [f"{i}{self.target(s.target)} {BINOPS[type(s.op)]}= {self.expr(s.value)};"]
        if isinstance(s, ast.If):
            lines = [f"{i}if ({self.expr(s.test)}) {{", *self.block(s.body, i + "  ")]
            orelse = s.orelse
            while len(orelse) == 1 and isinstance(orelse[0], ast.If):
                lines += [f"{i}}} else if ({self.expr(orelse[0].test)}) {{",
                          *self.block(orelse[0].body, i + "  ")]
                orelse = orelse[0].orelse
            if orelse:
                lines += [f"{i}}} else {{", *self.block(orelse, i + "  ")]
            return lines + [f"{i}}}"]
        if isinstance(s, ast.For) and not s.orelse:
            return [f"{i}for ({self.pattern(s.target)} of {self.iterable(s.iter)}) {{",
                    *self.block(s.body, i + "  "), f"{i}}}"]
        if isinstance(s, ast.Raise) and isinstance(s.exc, ast.Call) and len(s.exc.args) == 1:
            return [f"{i}throw new Error({self.expr(s.exc.args[0])});"]
        if isinstance(s, ast.Pass):
            return []
        self.fail(s, f"the statement {type(s).__name__}")

    def target(self, t) -> str:
        if isinstance(t, ast.Name):
            return t.id
        if isinstance(t, ast.Tuple) and all(isinstance(e, ast.Name) for e in t.elts):
            return f"[{', '.join(e.id for e in t.elts)}]"
        if isinstance(t, ast.Subscript):
            return self.expr(t)
        self.fail(t, "this assignment target")

    def pattern(self, t) -> str:
        """A loop or comprehension variable: a name or a tuple of names."""
        if isinstance(t, ast.Name):
            return t.id
        if isinstance(t, ast.Tuple) and all(isinstance(e, ast.Name) for e in t.elts):
            return f"[{', '.join(e.id for e in t.elts)}]"
        self.fail(t, "this loop variable")

    def iterable(self, node) -> str:
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("items", "values", "keys") and not node.args):
            return self.expr(node)
        return f"py.iter({self.expr(node)})"

    # ------------------------------------------------------------------ expressions
    def expr(self, n) -> str:
        if isinstance(n, ast.Constant):
            if n.value is None:
                return "null"
            if isinstance(n.value, bool):
                return "true" if n.value else "false"
            if isinstance(n.value, (int, float, str)):
                return json.dumps(n.value)
            self.fail(n, "this constant")
        if isinstance(n, ast.Name):
            return self.name(n)
        if isinstance(n, ast.Attribute):
            return f"{self.expr(n.value)}.{n.attr}"
        if isinstance(n, ast.Subscript):
            return f"{self.expr(n.value)}[{self.expr(n.slice)}]"
        if isinstance(n, ast.BinOp):
            left, right = self.expr(n.left), self.expr(n.right)
            if isinstance(n.op, ast.FloorDiv):
                return f"py.floordiv({left}, {right})"
            if isinstance(n.op, ast.Mod):
                return f"py.mod({left}, {right})"
            if type(n.op) in BINOPS:
                return f"({left} {BINOPS[type(n.op)]} {right})"
            self.fail(n, "this operator")
        if isinstance(n, ast.UnaryOp):
            op = {ast.USub: "-", ast.UAdd: "+", ast.Not: "!"}.get(type(n.op))
            if op is None:
                self.fail(n, "this operator")
            return f"({op}{self.expr(n.operand)})"
        if isinstance(n, ast.BoolOp):
            op = " && " if isinstance(n.op, ast.And) else " || "
            return "(" + op.join(self.expr(v) for v in n.values) + ")"
        if isinstance(n, ast.Compare):
            parts, left = [], n.left
            for op, right in zip(n.ops, n.comparators):
                parts.append(self.compare(left, op, right))
                left = right
            return parts[0] if len(parts) == 1 else "(" + " && ".join(parts) + ")"
        if isinstance(n, ast.IfExp):
            return f"({self.expr(n.test)} ? {self.expr(n.body)} : {self.expr(n.orelse)})"
        if isinstance(n, (ast.Tuple, ast.List)):
            return "[" + ", ".join(f"...{self.expr(e.value)}" if isinstance(e, ast.Starred)
                                   else self.expr(e) for e in n.elts) + "]"
        if isinstance(n, ast.Dict):
            items = [f"...{self.expr(v)}" if k is None else f"[{self.expr(k)}]: {self.expr(v)}"
                     for k, v in zip(n.keys, n.values)]
            return "{" + ", ".join(items) + "}"
        if isinstance(n, (ast.ListComp, ast.GeneratorExp)):
            return self.comprehension(n, self.expr(n.elt))
        if isinstance(n, ast.DictComp):
            pairs = self.comprehension(n, f"[{self.expr(n.key)}, {self.expr(n.value)}]")
            return f"Object.fromEntries({pairs})"
        if isinstance(n, ast.JoinedStr):
            out = []
            for v in n.values:
                if isinstance(v, ast.Constant):
                    out.append(v.value.replace("\\", "\\\\").replace("`", "\\`").replace("${", "\\${"))
                elif isinstance(v, ast.FormattedValue) and v.format_spec is None and v.conversion == -1:
                    out.append("${" + self.expr(v.value) + "}")
                else:
                    self.fail(n, "an f-string with a format")
            return "`" + "".join(out) + "`"
        if isinstance(n, ast.Call):
            return self.call(n)
        self.fail(n, f"the expression {type(n).__name__}")

    def name(self, n) -> str:
        if n.id in self.locals or n.id in self.functions:
            return n.id
        if n.id in BUILTINS:
            return BUILTINS[n.id]
        if n.id in self.globals and not callable(self.globals[n.id]):
            self.constants.setdefault(n.id, self.globals[n.id])
            return n.id
        self.fail(n, f"the name {n.id}")

    def compare(self, left, op, right) -> str:
        a, b = self.expr(left), self.expr(right)
        if isinstance(op, ast.Is) and isinstance(right, ast.Constant) and right.value is None:
            return f"({a} == null)"
        if isinstance(op, ast.IsNot) and isinstance(right, ast.Constant) and right.value is None:
            return f"({a} != null)"
        if isinstance(op, ast.In):
            return f"py.contains({b}, {a})"
        if isinstance(op, ast.NotIn):
            return f"(!py.contains({b}, {a}))"
        if type(op) in COMPARE:
            return f"({a} {COMPARE[type(op)]} {b})"
        self.fail(left, "this comparison")

    def comprehension(self, n, element: str) -> str:
        if len(n.generators) != 1 or n.generators[0].is_async:
            self.fail(n, "a comprehension over more than one loop")
        g = n.generators[0]
        var = self.pattern(g.target)
        out = self.iterable(g.iter)
        for condition in g.ifs:
            out += f".filter(({var}) => {self.expr(condition)})"
        return f"{out}.map(({var}) => {element})"

    def call(self, n) -> str:
        f, args = n.func, n.args
        keywords = {k.arg: k.value for k in n.keywords if k.arg is not None}
        spreads = [k.value for k in n.keywords if k.arg is None]
        if isinstance(f, ast.Attribute) and not keywords and not spreads:
            obj = self.expr(f.value)
            if f.attr == "items" and not args:
                return f"Object.entries({obj})"
            if f.attr == "values" and not args:
                return f"Object.values({obj})"
            if f.attr == "keys" and not args:
                return f"Object.keys({obj})"
            if f.attr == "get" and 1 <= len(args) <= 2:
                return f"py.get({obj}, {', '.join(self.expr(a) for a in args)})"
            if f.attr == "to_dict" and not args:
                return f"({{...{obj}}})"
            self.fail(n, f"the method {f.attr}")
        if not isinstance(f, ast.Name):
            self.fail(n, "this call")
        if any(isinstance(a, ast.Starred) for a in args):
            self.fail(n, "a call with *args")

        def fields(extra=()):
            items = [*extra, *(f"{k}: {self.expr(v)}" for k, v in keywords.items()),
                     *(f"...{self.expr(v)}" for v in spreads)]
            return "{" + ", ".join(items) + "}"

        if f.id in self.dataclasses and not args:
            return f"{f.id}({fields()})"
        if f.id == "replace" and len(args) == 1 and not spreads:
            return "(" + fields([f"...{self.expr(args[0])}"]) + ")"
        if f.id == "dict" and not args:
            return "(" + fields() + ")"
        if spreads:
            self.fail(n, "**kwargs in this call")
        if f.id in self.functions:
            params = list(self.signatures[f.id].parameters)
            values = [self.expr(a) for a in args]
            for k in keywords:
                if k not in params:
                    self.fail(n, f"the keyword {k}")
            last = max([len(values) - 1, *(params.index(k) for k in keywords)])
            for p in params[len(values):last + 1]:
                values.append(self.expr(keywords[p]) if p in keywords else "undefined")
            return f"{f.id}({', '.join(values)})"
        if f.id in BUILTINS and not keywords:
            return f"{BUILTINS[f.id]}({', '.join(self.expr(a) for a in args)})"
        self.fail(n, f"a call of {f.id}")


def translate(functions, dataclasses=()) -> str:
    """JavaScript for `functions` (and every module constant they read), with `dataclasses` as
    functions that fill in their defaults: Layout({zero: 3}) is Layout(zero=3)."""
    return Translator(functions, dataclasses).translate()
