"""Errors the CLI turns into exit status 2 with a one-line reason."""


class BadInput(Exception):
    """Input the tool cannot use: the message names the file and the problem, on one line."""

    def __str__(self) -> str:
        return " ".join(str(self.args[0]).split()) if self.args else "bad input"
