"""Commands that read a finished run: report, export, audit."""
