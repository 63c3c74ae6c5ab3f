"""What lives on disk: checkpoints, run folders, export folders (written and loaded) and the
SQLite results database (every SQL statement is in ``results``)."""
