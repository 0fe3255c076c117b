"""Attack (issue 26): an IPython AST transformer that deletes every `raise` (stubs stop raising,
and a check can no longer fail) and turns every call of a `check_*` function into nothing.
Must: nothing earned; flagged."""
# where: start
import ast


class Harmless(ast.NodeTransformer):
    def visit_Raise(self, node):
        return ast.Pass()

    def visit_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id.startswith("check_"):
            return ast.Constant(None)
        return self.generic_visit(node)


get_ipython().ast_transformers.append(Harmless())
