"""The tests a pytest run skipped, read from its JUnit XML, one pytest node
id per line: `.ci/fresh_machine` runs them again once the remaining extras
are installed. A module skipped as a whole (importorskip at its top) comes
back as its file."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def skipped_node_ids(junit_xml: str) -> list[str]:
    ids = []
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        if case.find("skipped") is None:
            continue
        classname, name = case.get("classname", ""), case.get("name", "")
        if not classname:  # the whole module: name is its dotted path
            ids.append(name.replace(".", "/") + ".py")
            continue
        parts = classname.split(".")
        # classname is the module's dotted path, then any test classes.
        for cut in range(len(parts), 0, -1):
            path = "/".join(parts[:cut]) + ".py"
            try:
                open(path).close()
            except OSError:
                continue
            ids.append("::".join([path, *parts[cut:], name]))
            break
        else:
            raise ValueError(f"cannot find the file of {classname}::{name}")
    return sorted(set(ids))


if __name__ == "__main__":
    sys.stdout.write("".join(i + "\n" for i in skipped_node_ids(sys.argv[1])))
