"""How every benchmark script ends: its result as JSON at --out (folders made as needed), and where it went."""
import json
import pathlib


def write_json(path: "str | pathlib.Path", result: dict, say: bool = True) -> pathlib.Path:
    """result (the script's device, date, command and rows) as indented JSON at path; prints "wrote PATH" (say)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    if say:
        print(f"wrote {path}")
    return path
