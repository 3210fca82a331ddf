"""Files (OpenAI Files API): metadata in the ``files`` table, content on disk.

Content lives under ``<data_dir>/files/<tenant>/<file id>``. Writes go to a
``.part`` file, are fsynced and renamed into place before the row is
committed, so a row never points at a half-written file. Every read is
filtered by tenant: another tenant's file id is indistinguishable from an
unknown one (404), so ids cannot be probed.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from tokenfleet.errors import TokenFleetError
from tokenfleet.service.db import session_scope
from tokenfleet.service.ledger import File

#: what a tenant may upload; outputs are written by us with their own purposes
UPLOAD_PURPOSES = ("batch",)
OUTPUT_PURPOSES = ("batch_output",)
#: OpenAI's batch input file limit
MAX_UPLOAD_BYTES = 200 * 1024 * 1024


class FileTooLarge(TokenFleetError):
    pass


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex


def file_object(f: File) -> dict[str, Any]:
    return {
        "id": f.id,
        "object": "file",
        "bytes": int(f.bytes),
        "created_at": int(f.created_at.timestamp()),
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileStore:
    def __init__(self, engine: Engine, root: str | Path) -> None:
        self.engine = engine
        self.root = Path(root)

    def path_for(self, tenant_id: str, file_id: str) -> Path:
        if "/" in file_id or "/" in tenant_id or file_id.startswith("."):
            raise ValueError("bad file id")
        return self.root / tenant_id / file_id

    def _write(self, path: Path, chunks: Iterable[bytes], max_bytes: int | None) -> int:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(path.name + ".part")
        size = 0
        try:
            with open(part, "wb") as fh:
                for chunk in chunks:
                    size += len(chunk)
                    if max_bytes is not None and size > max_bytes:
                        raise FileTooLarge(
                            f"file is larger than {max_bytes // (1024 * 1024)} MiB; split it"
                        )
                    fh.write(chunk)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(part, path)
            _fsync_dir(path.parent)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        return size

    def upload(
        self,
        tenant_id: str,
        purpose: str,
        filename: str,
        stream: IO[bytes],
        *,
        max_bytes: int = MAX_UPLOAD_BYTES,
    ) -> File:
        fid = new_file_id()
        path = self.path_for(tenant_id, fid)

        def chunks() -> Iterable[bytes]:
            while True:
                block = stream.read(1 << 20)
                if not block:
                    return
                yield block

        size = self._write(path, chunks(), max_bytes)
        with session_scope(self.engine) as session:
            row = File(
                id=fid,
                tenant_id=tenant_id,
                purpose=purpose,
                filename=filename,
                bytes=size,
                storage_path=str(path),
            )
            session.add(row)
        return row

    def write_generated(
        self, tenant_id: str, file_id: str, purpose: str, filename: str, lines: Iterable[bytes]
    ) -> File:
        """Write (or rewrite: idempotent) a file we produce, e.g. a batch's output."""
        path = self.path_for(tenant_id, file_id)
        size = self._write(path, lines, None)
        with session_scope(self.engine) as session:
            row = session.get(File, file_id)
            if row is None:
                row = File(
                    id=file_id,
                    tenant_id=tenant_id,
                    purpose=purpose,
                    filename=filename,
                    bytes=size,
                    storage_path=str(path),
                )
                session.add(row)
            else:
                row.bytes = size
                row.storage_path = str(path)
        return row

    def get(self, tenant_id: str, file_id: str) -> File | None:
        with session_scope(self.engine) as session:
            return session.execute(
                sa.select(File).where(File.id == file_id, File.tenant_id == tenant_id)
            ).scalar_one_or_none()

    def list(
        self,
        tenant_id: str,
        *,
        purpose: str | None = None,
        limit: int = 10000,
        after: str | None = None,
    ) -> list[File]:
        stmt = sa.select(File).where(File.tenant_id == tenant_id)
        if purpose:
            stmt = stmt.where(File.purpose == purpose)
        if after:
            stmt = stmt.where(File.id < after)
        stmt = stmt.order_by(File.created_at.desc(), File.id.desc()).limit(limit)
        with session_scope(self.engine) as session:
            return list(session.scalars(stmt))

    def open(self, f: File) -> IO[bytes]:
        return open(f.storage_path, "rb")

    def delete(self, tenant_id: str, file_id: str) -> bool:
        from tokenfleet.service.ledger import Batch

        with session_scope(self.engine) as session:
            row = session.execute(
                sa.select(File)
                .where(File.id == file_id, File.tenant_id == tenant_id)
                .with_for_update()
            ).scalar_one_or_none()
            if row is None:
                return False
            used = session.execute(
                sa.select(sa.func.count())
                .select_from(Batch)
                .where(
                    sa.or_(
                        Batch.input_file_id == file_id,
                        Batch.output_file_id == file_id,
                        Batch.error_file_id == file_id,
                    )
                )
            ).scalar_one()
            if used:
                raise TokenFleetError(f"file {file_id} belongs to a batch and cannot be deleted")
            path = row.storage_path
            session.delete(row)
        Path(path).unlink(missing_ok=True)
        return True
