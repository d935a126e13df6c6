"""scripts/make_demo_corpus.py: the functions of a standard library, line numbers as ast counts them."""

import runpy
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_demo_corpus.py"


def test_a_form_feed_does_not_shift_the_definitions(tmp_path):
    """Debian's email package has form feeds between definitions: each code still starts at its `def`."""
    (tmp_path / "mail").mkdir()
    (tmp_path / "mail" / "__init__.py").write_text(
        '"""A package."""\n\x0c\n# a comment\ndef parse(text, *, strict=False):\n'
        '    """Parse the text of a message into its parts."""\n    return text.split("\\n")\n\n\n'
        "class Parser:\n    def feed(self, data):\n"
        '        """Feed more data to the parser, one chunk at a time."""\n        self.data += data\n'
    )
    (tmp_path / "test_x.py").write_text('def ignored(a):\n    """Skipped: a test."""\n    return a + 1 + 2 + 3 + 4\n')
    functions = runpy.run_path(str(SCRIPT), run_name="under_test")["stdlib_functions"](tmp_path)
    assert [(f.module, f.name, f.signature) for f in functions] == [
        ("mail", "parse", "(text, *, strict=False)"),
        ("mail", "Parser.feed", "(self, data)"),
    ]
    assert functions[0].code.startswith("def parse(") and functions[0].summary.startswith("Parse the text")
    assert functions[1].code.splitlines()[1].startswith('    """Feed')
