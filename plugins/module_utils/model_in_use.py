# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The records of the vLLM instances and the model revisions they name, so model_weights never prunes a revision
an instance runs or would roll back to.

plugins/modules/vllm_instance.py writes one record per instance (/etc/vllm/<name>.record.json, and the rollback
target's under /etc/vllm/rollback/): JSON of schema 1 whose model_path is the revision directory the unit loads and
whose model_revision is that directory's name (null when model_path is not under a "revisions" directory).

Stdlib only: runs on the managed hosts and on the control node."""

import glob
import json
import os

INSTANCE_RECORD_SCHEMA = 1


def _record_revisions(record, revisions_dir):
    """The revisions of revisions_dir that one parsed record names; raises ValueError when it cannot be told."""
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {type(record).__name__}, not an object")
    if record.get("schema") != INSTANCE_RECORD_SCHEMA:
        raise ValueError(f"schema {record.get('schema')!r}, this module reads schema {INSTANCE_RECORD_SCHEMA}")
    rev, path = record.get("model_revision"), record.get("model_path")
    if rev is not None and (not isinstance(rev, str) or not rev or "/" in rev):
        raise ValueError(f"model_revision {rev!r} is not a revision id")
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError(f"model_path {path!r} is not an absolute path")
    found = {rev} if rev else set()
    path = os.path.normpath(path)
    # realpath of the parent only: the revisions directory may sit behind a link (e.g. /srv/models -> /data/models),
    # but model_path itself must not be resolved (the served symlink now points elsewhere than what the unit loads).
    if os.path.realpath(os.path.dirname(path)) == os.path.realpath(revisions_dir):
        found.add(os.path.basename(path))
    return found


def revisions_in_use(patterns, revisions_dir):
    """Read the instance records matching the glob patterns: ({revision: [record paths]}, [problems]).

    A record that cannot be read or understood is a problem ("<path>: <why>"), never silently skipped: the caller
    must then assume any revision may be in use. A record that vanished between the glob and the read is gone (its
    instance was removed) and names nothing.
    """
    used = {}
    problems = []
    for path in sorted({p for pattern in patterns for p in glob.glob(pattern)}):
        try:
            with open(path, encoding="utf-8") as fh:
                record = json.load(fh)
            revisions = _record_revisions(record, revisions_dir)
        except FileNotFoundError:
            continue
        except OSError as e:
            problems.append(f"{path}: {e.strerror or e}")
            continue
        except json.JSONDecodeError as e:
            problems.append(f"{path}: not valid JSON ({e})")
            continue
        except UnicodeDecodeError:
            problems.append(f"{path}: not UTF-8 text")
            continue
        except ValueError as e:
            problems.append(f"{path}: {e}")
            continue
        for rev in revisions:
            used.setdefault(rev, []).append(path)
    return used, problems
