"""Runbooks: every alert has a page, every page has the four sections, and what a page tells an operator
to run from the bundle (playbooks, scripts, linked pages) exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNBOOKS = ROOT / "docs" / "runbooks"
ALERT_RULES = ROOT / "roles" / "observability" / "templates" / "pd-alerts.yml.j2"
PAGES = sorted(p for p in RUNBOOKS.glob("*.md") if p.name != "README.md")


def kebab(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "-", name).lower()


def alert_names() -> list[str]:
    return re.findall(r"^\s*- alert:\s*(\w+)", ALERT_RULES.read_text(), re.M)


def test_there_are_alerts_and_pages():
    assert len(alert_names()) >= 10
    assert len(PAGES) >= 15


@pytest.mark.parametrize("alert", alert_names())
def test_every_alert_has_its_page_and_the_rule_links_to_it(alert):
    page = RUNBOOKS / f"{kebab(alert)}.md"
    assert page.exists(), f"alert {alert} has no runbook {page.relative_to(ROOT)}"
    assert alert in page.read_text().splitlines()[0], f"{page.name} does not name {alert} in its title"
    assert f"/{kebab(alert)}.md" in ALERT_RULES.read_text()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_has_symptom_checks_fix_rollback(page):
    headings = re.findall(r"^## (\w+)", page.read_text(), re.M)
    assert headings[:4] == ["Symptom", "Checks", "Fix", "Rollback"], headings


@pytest.mark.parametrize("page", [*PAGES, RUNBOOKS / "README.md"], ids=lambda p: p.name)
def test_bundle_commands_and_links_exist(page):
    text = page.read_text()
    for path in set(re.findall(r"\b((?:playbooks|scripts)/[\w-]+(?:\.(?:yml|py))?)", text)):
        assert (ROOT / path).exists(), f"{page.name} names {path}, which is not in the bundle"
    for link in re.findall(r"\]\(([\w.-]+\.md)\)", text):
        assert (RUNBOOKS / link).exists(), f"{page.name} links {link}, which does not exist"


def test_index_lists_every_page():
    index = (RUNBOOKS / "README.md").read_text()
    for page in PAGES:
        assert f"({page.name})" in index, f"README.md does not list {page.name}"
