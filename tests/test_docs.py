"""The README and the docs site (mkdocs.yml + docs/) hold what they promise.

- the README stays a page (at most 300 lines) with the two commands, and its links resolve;
- every TOML block in the README and the docs is a configuration ``rmqfast.config`` accepts
  (a block that shows one section is checked with a name-server upstream added, and the PEM
  files it names are made for the test);
- the hand-written configuration reference names every key ``rmqfast.config`` accepts;
- ``mkdocs build --strict`` passes, and fails on a page left out of the nav and on a broken link
  (so the strict build in ``make test`` cannot pass by not looking).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from rmqfast import config as config_mod
from rmqfast.settings import engine
from rmqfast.testing.tlscerts import make_certs

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MKDOCS_YML = ROOT / "mkdocs.yml"

_TOML_BLOCK = re.compile(r"^( *)```toml\n(.*?)^ *```", re.S | re.M)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _toml_blocks(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of each ```toml block of a Markdown file, its list indentation removed."""
    text = path.read_text()
    blocks = []
    for m in _TOML_BLOCK.finditer(text):
        indent = len(m.group(1))
        body = "\n".join(line[indent:] for line in m.group(2).splitlines())
        blocks.append((text.count("\n", 0, m.start()) + 1, body))
    return blocks


def _github_slug(heading: str) -> str:
    slug = heading.strip().lower()
    slug = re.sub(r"[^\w\- ]", "", slug)
    return slug.replace(" ", "-")


def test_readme_is_one_page_with_the_two_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail into a page of docs/"
    text = "\n".join(lines)
    commands = re.findall(r"^(make \w+)\s", text, re.M)
    assert commands == ["make demo", "make test"], f"README.md's command lines: {commands}"


def test_readme_links_resolve() -> None:
    text = README.read_text()
    headings = {_github_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    checked = 0
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        if path:
            assert (ROOT / path).exists(), f"README.md links to {target}, which does not exist"
        else:
            assert anchor in headings, f"README.md links to #{anchor}; its headings: {sorted(headings)}"
        checked += 1
    assert checked >= 20, f"only {checked} relative links found in README.md"


def _with_real_files(raw: dict[str, Any], certs_dir: Path) -> None:
    """Point the [tls.*] PEM paths of a documentation block at certificates made for the test."""
    tls = raw.get("tls")
    if not isinstance(tls, dict):
        return
    certs = make_certs(certs_dir)
    files = {"cert": certs.server_cert, "key": certs.server_key, "ca": certs.ca}
    for side in ("listen", "upstream"):
        table = tls.get(side)
        if not isinstance(table, dict):
            continue
        for key, path in files.items():
            if table.get(key):
                table[key] = str(path)
        if side == "upstream" and table.get("cert"):
            table["cert"], table["key"] = str(certs.client_cert), str(certs.client_key)


def test_every_toml_block_of_the_docs_is_a_valid_configuration(tmp_path: Path) -> None:
    sources = [README, *sorted(DOCS.glob("*.md"))]
    checked: list[str] = []
    for path in sources:
        for line, body in _toml_blocks(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            try:
                raw = tomllib.loads(body)
            except tomllib.TOMLDecodeError as e:
                pytest.fail(f"{where}: the TOML block does not parse: {e}")
            namesrv = raw.setdefault("namesrv", {})
            namesrv.setdefault("upstreams", ["10.0.0.1:9876"])  # a block that shows one section
            _with_real_files(raw, tmp_path / f"certs-{len(checked)}")
            try:
                config_mod.from_dict(raw)
            except config_mod.ConfigError as e:
                pytest.fail(f"{where}: the configuration block is refused:\n{e}")
            checked.append(where)
    sections = {"README.md", "docs/configuration.md", "docs/limits.md", "docs/delay.md", "docs/tls.md",
                "docs/grpc.md", "docs/gray.md", "docs/failover.md", "docs/cross-cloud.md", "docs/acl.md"}
    assert sections <= {c.split(":")[0] for c in checked}, f"blocks checked: {checked}"


def _mkdocs_build(config_file: Path, site_dir: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config_file),
         "--site-dir", str(site_dir)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )


def test_docs_site_builds_strict(tmp_path: Path) -> None:
    done = _mkdocs_build(MKDOCS_YML, tmp_path / "site")
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    assert "WARNING" not in done.stderr, done.stderr
    built = {p.parent.name for p in (tmp_path / "site").glob("*/index.html")}
    pages = {p.stem for p in DOCS.glob("*.md") if p.stem != "index"}
    assert pages <= built, f"pages not built: {sorted(pages - built)}"


def test_docs_strict_build_fails_on_an_orphan_page_and_a_broken_link(tmp_path: Path) -> None:
    copy = tmp_path / "repo"
    shutil.copytree(DOCS, copy / "docs")
    shutil.copy(MKDOCS_YML, copy / "mkdocs.yml")
    (copy / "docs" / "orphan.md").write_text("# Not in the nav\n")
    done = _mkdocs_build(copy / "mkdocs.yml", tmp_path / "site-orphan")
    assert done.returncode != 0 and "orphan.md" in done.stderr, done.stderr
    (copy / "docs" / "orphan.md").unlink()
    with (copy / "docs" / "metrics.md").open("a") as f:
        f.write("\nSee [the limits](limits.md#no-such-part).\n")
    done = _mkdocs_build(copy / "mkdocs.yml", tmp_path / "site-link")
    assert done.returncode != 0 and "no-such-part" in done.stderr, done.stderr


def _declared_keys() -> dict[str, set[str]]:
    """Every section the settings registry knows, with its TOML keys (the engine's declarations; a
    section with a parser of its own: its dataclass fields)."""
    assert config_mod.Config  # the sections register when their modules are imported
    out: dict[str, set[str]] = {}
    for name, spec in engine.sections().items():
        out[name] = set(engine.toml_keys(spec.cls)) if spec.parse is None else \
            {f.name for f in dataclasses.fields(spec.cls)}
    assert {"proxy", "grpc", "delay", "gray", "limits"} <= set(out), sorted(out)
    return out


def test_configuration_reference_names_every_key() -> None:
    """docs/configuration.md is written by hand: a key the parser accepts must still be named there."""
    text = (DOCS / "configuration.md").read_text()
    missing = []
    for section, keys in _declared_keys().items():
        for key in sorted(keys):
            tables = (f"[[{section}.{key}]]", f"[[{section}.{key.removesuffix('s')}]]")  # [[limits.rule]]
            if f"`{key}`" in text or any(t in text for t in tables) \
                    or re.search(rf"^\s*#?\s*{key}\s*=", text, re.M):
                continue
            missing.append(f"{section}.{key}")
    assert not missing, f"docs/configuration.md does not name {missing}"
    assert "[proxy]" in text and "[grpc]" in text, "the reference lost its sections"
