"""Print the comment-and-docstring share of non-blank lines, per directory.

Share = (docstring lines + comment-only lines) / non-blank lines, counted with tokenize.
Usage: python tools/comment_share.py [PATH ...]   (default: twinshard)
"""
import ast
import collections
import io
import pathlib
import sys
import tokenize


def count(path):
    """(comment-or-docstring lines, non-blank lines) of one Python file."""
    src = pathlib.Path(path).read_text()
    nonblank = {i for i, line in enumerate(src.splitlines(), 1) if line.strip()}
    doc = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                doc.update(range(body[0].lineno, body[0].end_lineno + 1))
    code = set()
    comment = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comment.add(tok.start[0])
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER):
            code.update(range(tok.start[0], tok.end[0] + 1))
    code -= doc
    explained = (doc | (comment - code)) & nonblank
    return len(explained), len(nonblank)


def main(paths):
    rows = collections.defaultdict(lambda: [0, 0])
    for root in paths:
        root = pathlib.Path(root)
        for f in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
            c, n = count(f)
            for key in (str(f.parent), "TOTAL " + str(root)):
                rows[key][0] += c
                rows[key][1] += n
    for key, (c, n) in sorted(rows.items()):
        print(f"{key:40s} {c:6d}/{n:6d}  {100 * c / max(n, 1):5.1f}%")


if __name__ == "__main__":
    main(sys.argv[1:] or ["twinshard"])
