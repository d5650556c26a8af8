# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The model_weights module's parameters and the source they name: the checks run before anything is read or
written, and the source (its fetcher, built when first needed, and its manifest, validated against the revision).

Stdlib only: runs on the managed hosts."""

import os
import re
import shutil
import tempfile
import urllib.parse

from ansible_collections.b300.pd.plugins.module_utils.model_errors import WeightsError
from ansible_collections.b300.pd.plugins.module_utils.model_fetchers import (
    HfFetcher,
    HttpFetcher,
    PathFetcher,
    RsyncFetcher,
)
from ansible_collections.b300.pd.plugins.module_utils.model_manifest import SHA1_RE, validate_manifest

REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_params(params, link, pin_mode=False):
    """Refuse parameters the module cannot act on safely, with a message saying what to fix; link is the absolute
    served path (not looked at in pin mode: that runs on the control node, whose disk holds no served path)."""
    src = params["source"]
    revision = params["revision"]
    if not REVISION_RE.match(revision):
        raise WeightsError(f"revision {revision!r} is not a plain revision id ([A-Za-z0-9._-], no '/')")
    if params["keep"] < 1:
        raise WeightsError(f"keep must be >= 1 (got {params['keep']})")
    relative = [p for p in params["in_use_records"] if not p.startswith("/")]
    if relative:
        raise WeightsError(
            f"in_use_records {relative} must be absolute glob patterns (e.g. /etc/vllm/*.record.json): a relative "
            "one would be read from wherever the module happens to run (model_weights_in_use_records)"
        )
    t = src["type"]
    if src.get("revision") and src["revision"] != revision:
        raise WeightsError(f"source.revision {src['revision']} differs from revision {revision}")
    if t == "hf":
        if not src.get("repo_id"):
            raise WeightsError("source.repo_id is required for source.type=hf")
        if not SHA1_RE.match(revision):
            raise WeightsError(
                f"revision {revision!r} for hf repo {src['repo_id']} must be a full 40-hex commit id "
                "(pin pd_model_source.revision; branch names and tags move)"
            )
    elif t == "http" and not src.get("url"):
        raise WeightsError("source.url is required for source.type=http")
    elif t in ("path", "peer") and not src.get("path"):
        raise WeightsError(f"source.path is required for source.type={t}")
    if params["token"] and t in ("hf", "http"):
        field, url = ("source.endpoint", src["endpoint"]) if t == "hf" else ("source.url", src["url"])
        if urllib.parse.urlsplit(url).scheme.lower() != "https":
            raise WeightsError(
                f"{field} {url} is not https but a token is set: the token (model_weights_token / pd_hf_token) "
                f"would travel in clear text; use an https:// {field.split('.')[1]}, or unset the token for a "
                "source that needs none"
            )
    if not pin_mode and os.path.lexists(link) and not os.path.islink(link):
        raise WeightsError(
            f"{link} exists and is not a symlink; move it away (it is the served path model_weights manages)"
        )


class WeightsSource:
    """The source option as a fetcher: built on first use, so a healthy host never contacts the source."""

    def __init__(self, params, bufsize, run_command):
        self.params = params
        self.bufsize = bufsize
        self.run_command = run_command
        self._fetcher = None

    def fetcher(self):
        if self._fetcher is None:
            p = self.params
            src = p["source"]
            t = src["type"]
            if t == "hf":
                self._fetcher = HfFetcher(
                    src["repo_id"], p["revision"], endpoint=src["endpoint"], token=p["token"],
                    timeout=p["timeout"], bufsize=self.bufsize, retries=p["retries"],
                )
            elif t == "http":
                self._fetcher = HttpFetcher(
                    src["url"], token=p["token"], timeout=p["timeout"], bufsize=self.bufsize, retries=p["retries"]
                )
            elif t == "path":
                self._fetcher = PathFetcher(src["path"], bufsize=self.bufsize)
            else:
                self._fetcher = RsyncFetcher(
                    self.run_command, src["path"], host=src.get("host"), user=src.get("user"),
                    port=src.get("port"), ssh_key=src.get("ssh_key"), ssh_args=src.get("ssh_args"),
                    name=src.get("name"),
                )
        return self._fetcher

    def describe(self):
        return self.fetcher().describe()

    def manifest(self):
        """The source's manifest of the revision, validated (a ManifestError when it is not that revision's)."""
        f = self.fetcher()
        if isinstance(f, RsyncFetcher):
            tmp = tempfile.mkdtemp(prefix="model-weights-")
            try:
                m = f.manifest(tmp)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        else:
            m = f.manifest()
        return validate_manifest(m, expected_revision=self.params["revision"], origin=f"source {f.describe()}")
