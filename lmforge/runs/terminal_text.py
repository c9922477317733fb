"""The plain text a terminal keeps of what a program wrote to it.

A foreground run's trainer writes to a terminal (the supervisor gives it one, so that it draws its
live progress bar), and the run's log file gets the same bytes. Written as they are, the log holds
every redraw of the bar — its carriage returns, erased lines and colour codes — as a terminal
receives them, not as it shows them. `TerminalText` applies what those codes do to a few lines of
screen and hands on the lines a terminal would keep, once they are done: the log reads like the
scroll-back of the terminal (a bar drawn in place leaves its last frame, once), and nothing of it is
an escape code.

A finished line is handed on at once. A program that redraws several lines from above (cursor up)
is learned from: from then on that many finished lines wait, since the cursor may come back to them
(lmforge's own bar is one line high, so its lines never wait).
"""

from __future__ import annotations

import codecs
import re

# One token of the stream: a CSI sequence (ESC [ params final), an OSC sequence (ESC ] … BEL or ST),
# another two-byte escape, one control character, or a run of printable text.
_TOKEN = re.compile(r"\x1b\[([0-?]*)[ -/]*([@-~])|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[ -/]*[0-~]|"
                    r"([\x00-\x1a\x1c-\x1f\x7f])|([^\x00-\x1f\x7f]+)")
_LONGEST_CUT = 4096  # an ESC with no complete sequence after this many characters starts none


class TerminalText:
    """Feed it bytes (`feed`), get back the lines that are done; `close` gives the rest."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._lines = [""]  # the lines the cursor may still reach; the cursor is on _lines[_row]
        self._row = 0
        self._col = 0
        self._hold = 0  # how far above its line the cursor has been moved: that many done lines wait
        self._cut = ""  # an escape sequence cut by the end of the last read

    def feed(self, data: bytes) -> list[str]:
        text = self._cut + self._decoder.decode(data)
        self._cut = ""
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None:  # an ESC whose sequence is not complete yet, or never will be
                if len(text) - pos < _LONGEST_CUT:
                    self._cut = text[pos:]
                    break
                pos += 1  # not an escape sequence: the ESC alone is dropped
                continue
            pos = m.end()
            params, final, control, printable = m.groups()
            if printable is not None:
                self._write(printable)
            elif control is not None:
                self._control(control)
            elif final is not None:
                self._csi(params, final)
        return self._done()

    def close(self) -> list[str]:
        """Every line left, the one the cursor is on included (the last text may have no newline)."""
        self._write(self._decoder.decode(b"", final=True) + self._cut.replace("\x1b", ""))
        self._cut = ""
        lines = [ln.rstrip() for ln in self._lines]
        while lines and not lines[-1]:
            lines.pop()
        self._lines, self._row, self._col = [""], 0, 0
        return lines

    # --- what the codes do

    def _write(self, s: str) -> None:
        line = self._lines[self._row].ljust(self._col)
        self._lines[self._row] = line[:self._col] + s + line[self._col + len(s):]
        self._col += len(s)

    def _control(self, c: str) -> None:
        if c == "\n":  # (a pty turns it into CR LF; a log's next line starts at its first column)
            self._row += 1
            if self._row == len(self._lines):
                self._lines.append("")
            self._col = 0
        elif c == "\r":
            self._col = 0
        elif c == "\b":
            self._col = max(0, self._col - 1)
        elif c == "\t":
            self._write(" " * (8 - self._col % 8))
        # other control characters (a bell) show nothing

    def _csi(self, params: str, final: str) -> None:
        if params.startswith("?"):  # private modes (cursor shown or hidden, …)
            return
        n = int(params.split(";")[0]) if params.split(";")[0].isdigit() else None
        line = self._lines[self._row]
        if final == "K":  # erase in line: 0 to its end, 1 to the cursor, 2 all of it
            self._lines[self._row] = (line[:self._col] if not n else
                                      " " * (self._col + 1) + line[self._col + 1:] if n == 1 else "")
        elif final == "J":  # erase in display: 0 below the cursor, 2 and 3 everything (here: what is held)
            if n in (2, 3):
                self._lines = [""] * len(self._lines)
            else:
                self._lines[self._row] = line[:self._col]
                del self._lines[self._row + 1:]
        elif final == "A":
            up = n or 1
            self._hold = max(self._hold, up)
            self._row = max(0, self._row - up)  # lines already handed on cannot be reached
        elif final == "B":
            for _ in range(n or 1):
                self._control("\n")
        elif final == "G":
            self._col = max(0, (n or 1) - 1)
        elif final == "C":
            self._col += n or 1
        elif final == "D":
            self._col = max(0, self._col - (n or 1))
        # colours (m) and everything else change nothing in the text

    def _done(self) -> list[str]:
        ready = max(0, self._row - self._hold)
        out = [ln.rstrip() for ln in self._lines[:ready]]
        del self._lines[:ready]
        self._row -= ready
        return out
