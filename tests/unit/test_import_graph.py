"""No import cycles among the package's modules, counting imports inside functions too (a lazy import hides a
cycle from the interpreter, not from the reader).

Module names follow setup.cfg's package_dir: `scheduler/`, `workers/`, `launch/` and `bench/` are
`nanovllm_tp.scheduler`, `nanovllm_tp.workers`, `nanovllm_tp.launch` and `nanovllm_tp.bench`. Edges are the
imports as written: `import a.b` and `from a import b` point at module `a.b` when it exists (else at `a`); a
package's `__init__` is not implied.
"""
import ast
import configparser
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
_CFG = configparser.ConfigParser()
_CFG.read(REPO / "setup.cfg")
ROOTS = {name.strip(): REPO / folder.strip() for name, folder in
         (line.split("=") for line in _CFG["options"]["package_dir"].strip().splitlines())}
MAPPED = [name.split(".")[1:2] for name in ROOTS if name != "nanovllm_tp"]


def package_modules() -> dict[str, pathlib.Path]:
    modules = {}
    for prefix, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([prefix, *parts])
            if prefix == "nanovllm_tp" and name.split(".")[1:2] in MAPPED:
                continue        # a folder of that name inside nanovllm_tp/ would be shadowed by the mapping
            modules[name] = path
    return modules


def imports_of(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """The package modules that `name` imports anywhere in its file (module level, functions, classes), by
    import statements and by `importlib.import_module` with a literal or f-string name (an f-string reaches
    every module its literal head could name). Blocks under `if TYPE_CHECKING:` never run: not counted."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()

    def target(dotted: str) -> None:
        while dotted and dotted not in modules:      # `import a.b.func`-like spellings resolve to a module
            dotted = dotted.rpartition(".")[0]
        if dotted and dotted != name:
            found.add(dotted)

    def dynamic(arg: ast.expr) -> None:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            target(arg.value)
        elif isinstance(arg, ast.JoinedStr) and arg.values:
            head = arg.values[0]
            if isinstance(head, ast.Constant):
                prefix = head.value
            elif isinstance(head.value, ast.Name) and head.value.id in ("__name__", "__package__"):
                prefix = (name if head.value.id == "__name__" else package) + "."
            else:
                return
            found.update(m for m in modules if m.startswith(prefix) and m != name)

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node):
            test = node.test
            if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
                    (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
                for child in node.orelse:
                    self.visit(child)
            else:
                self.generic_visit(node)

        def visit_Import(self, node):
            for alias in node.names:
                target(alias.name)

        def visit_ImportFrom(self, node):
            if node.level:      # relative: from the module's package, `level - 1` packages up
                base = package.split(".")
                source = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                target(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source)

        def visit_Call(self, node):
            func = node.func
            if node.args and (getattr(func, "attr", None) or getattr(func, "id", None)) == "import_module":
                dynamic(node.args[0])
            self.generic_visit(node)

    Visitor().visit(ast.parse(path.read_text(), str(path)))
    return found


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path that ends where it starts, or None (iterative depth-first search)."""
    state = dict.fromkeys(graph, 0)     # 0 unseen, 1 on the current path, 2 done
    for start in sorted(graph):
        if state[start]:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state[nxt] == 1:
                return path[path.index(nxt):] + [nxt]
            elif state[nxt] == 0:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert {"nanovllm_tp.engine.llm_engine", "nanovllm_tp.scheduler.plan", "nanovllm_tp.workers.worker",
            "nanovllm_tp.launch.generate"} <= graph.keys()
    # lazy imports inside functions count
    assert "nanovllm_tp.workers.worker" in graph["nanovllm_tp.engine.llm_engine"]
    assert "nanovllm_tp.engine.llm_engine" in graph["nanovllm_tp.entrypoints.llm"]


def test_find_cycle_reports_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    cycle = find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
