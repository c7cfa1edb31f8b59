"""Whatever another person made reaches the program through this package: one narrow door.

A run folder, a sweep folder, a checkpoint, a config or an annotation file can be shared by a
stranger and crafted (docs/cluster.md, "A shared run folder is untrusted input"). This is the
bottom layer (it imports no other videotrain module), so the same rules hold everywhere:

* ``text``: a value read from a file is shown escaped and cut, never raw;
* ``files``: the one reader and the one writer: regular files only, sizes bounded before
  reading, writes that never follow a link;
* ``bounds``: the declared types and bounds every value read from a file is checked against;
* ``run_folder``: a run folder is checked before anything is written into it (fail closed);
* ``own``: the user's own runs, told apart by a keyed digest (a seal) a stranger cannot forge.
"""

from videotrain.untrusted.bounds import (
    FILE_DATA_BOUNDS,
    MAX_CONFIG_DEPTH,
    MAX_CONFIG_NODES,
    BadValue,
    checked,
    plain_tree_problem,
)
from videotrain.untrusted.files import (
    UnsafeFileError,
    is_regular,
    open_append,
    open_regular,
    read_bytes,
    read_text,
    write_bytes,
    write_text,
)
from videotrain.untrusted.formats import read_json, read_jsonl
from videotrain.untrusted.own import (
    canonical_json,
    is_sealed,
    is_sealed_config,
    is_sealed_file,
    seal,
    seal_config,
    write_seal,
)
from videotrain.untrusted.run_folder import (
    MAX_RUN_FOLDER_ENTRIES,
    RunFolderCheck,
    UnsafeRunFolder,
    check_run_folder,
    run_folder_problems,
)
from videotrain.untrusted.text import NAME_CHARS, PATH_CHARS, SHOWN_CHARS, quoted, shown, shown_name

__all__ = [
    "BadValue", "checked", "read_json", "read_jsonl",
    "FILE_DATA_BOUNDS", "NAME_CHARS", "canonical_json", "is_sealed", "is_sealed_config",
    "is_sealed_file", "seal", "seal_config", "shown_name", "write_seal",
    "MAX_CONFIG_DEPTH", "MAX_CONFIG_NODES", "MAX_RUN_FOLDER_ENTRIES", "PATH_CHARS", "SHOWN_CHARS",
    "RunFolderCheck", "UnsafeFileError", "UnsafeRunFolder", "check_run_folder", "is_regular",
    "open_append", "open_regular", "plain_tree_problem", "quoted", "read_bytes", "read_text",
    "run_folder_problems", "shown", "write_bytes", "write_text",
]
