"""The manifest's load-bearing fields, `dynamic_past` and `parts`: typed, checked at load (one line when malformed),
and still read from `extra`, where manifests before format version 5 keep them."""
from __future__ import annotations

import json
import shutil

import pytest
from test_cli_errors import assert_one_line_error, staticlm

from staticlm.export.parts import add_parts
from staticlm.runtime.engine.parts import NoParts, part_entries, part_layers
from staticlm.runtime.family.manifest import (
    FORMAT_VERSION,
    IN_PLACE_ROPE_VERSION,
    MANIFEST_NAME,
    READABLE_VERSIONS,
    TYPED_FIELDS_VERSION,
    ManifestError,
    load_manifest,
)
from staticlm.runtime.session.device import context_groups


@pytest.fixture(scope="module")
def parted_family(tiny_family, tmp_path_factory):
    """The tiny float family cut into its two layers' parts."""
    out = tmp_path_factory.mktemp("manifest") / "family"
    shutil.copytree(tiny_family, out)
    add_parts(out, 2)
    return out


@pytest.fixture
def family_copy(parted_family, tmp_path):
    out = tmp_path / "family"
    shutil.copytree(parted_family, out)
    return out


def _data(family) -> dict:
    return json.loads((family / MANIFEST_NAME).read_text())


def _write(family, data: dict) -> None:
    (family / MANIFEST_NAME).write_text(json.dumps(data))


def _as_version_4(data: dict, *, dynamic_past: bool) -> dict:
    """The same manifest as format version 4 wrote it: the two fields kept in `extra`."""
    old = {k: v for k, v in data.items() if k not in ("dynamic_past", "parts")}
    old["extra"] = {**data["extra"], "parts": data["parts"], **({"dynamic_past": True} if dynamic_past else {})}
    return {**old, "format_version": 4}


def test_parts_are_a_typed_field_read_by_the_runtime(parted_family):
    data = _data(parted_family)
    assert data["format_version"] == FORMAT_VERSION >= TYPED_FIELDS_VERSION and "parts" not in data["extra"]
    assert data["dynamic_past"] is False  # a float family's graphs take their own past length only
    manifest = load_manifest(parted_family)
    assert part_layers(manifest) == [(0, 1), (1, 2)]
    decode = manifest.graphs_of(manifest.graphs[0].kind)[0]
    chain = part_entries(manifest, decode)
    assert [e.name for e in chain] == [f"{decode.name}.part0", f"{decode.name}.part1"]
    assert all((parted_family / e.file).is_file() and e.shape == decode.shape for e in chain)
    groups = context_groups(parted_family)  # the whole graphs, then each layer group's parts
    assert len(groups) == 3 and not any(".part" in f.name for f in groups[0])
    assert all(f.name.endswith(f".part{k}.onnx") for k in (0, 1) for f in groups[1 + k])
    assert {f.name for f in groups[1]} == {c[0].file for c in manifest.parts.graphs.values()}


@pytest.mark.parametrize("dynamic_past", [False, True])
def test_a_version_4_manifest_loads_its_fields_from_extra(family_copy, dynamic_past):
    assert 4 in READABLE_VERSIONS
    new, new_groups = load_manifest(family_copy), context_groups(family_copy)
    _write(family_copy, _as_version_4(_data(family_copy), dynamic_past=dynamic_past))
    old = load_manifest(family_copy)
    assert old.format_version == 4 and old.dynamic_past is dynamic_past
    assert old.parts == new.parts and part_layers(old) == [(0, 1), (1, 2)]
    assert old.extra == new.extra  # the two keys moved out of extra
    assert context_groups(family_copy) == new_groups
    old.save(family_copy)  # saved in this version's layout
    again = _data(family_copy)
    assert again["format_version"] == FORMAT_VERSION and again["dynamic_past"] is dynamic_past
    assert "parts" not in again["extra"] and load_manifest(family_copy).parts == new.parts


def test_a_family_without_parts_says_so(tiny_family):
    manifest = load_manifest(tiny_family)
    assert manifest.parts is None and part_layers(manifest) is None
    with pytest.raises(NoParts, match="--parts N"):
        part_entries(manifest, manifest.graphs[0])


def _old_with_extra(data: dict, **extra) -> None:
    """data as format version 4, with these keys in its extra."""
    old = _as_version_4(data, dynamic_past=False)
    old["extra"].update(extra)
    data.clear()
    data.update(old)


def _first_chain(data: dict) -> list:
    return next(iter(data["parts"]["graphs"].values()))


@pytest.mark.parametrize(("corrupt", "words"), [
    (lambda d: d.update(dynamic_past="yes"), "dynamic_past must be true or false"),
    (lambda d: d.update(dynamic_past=1), "dynamic_past must be true or false"),
    (lambda d: d.update(parts=[[0, 1], [1, 2]]), "parts must be an object"),
    (lambda d: d["parts"].update(layers=[[0, 1]]), "parts.layers"),  # layer 1 in no group
    (lambda d: d["parts"].update(layers=[[0, 2], [1, 2]]), "parts.layers"),  # overlapping
    (lambda d: d["parts"].update(layers=[[1, 0], [0, 2]]), "parts.layers"),
    (lambda d: d["parts"].update(layers=[[0, "1"], ["1", 2]]), "parts.layers"),
    (lambda d: d["parts"]["graphs"].update(nope=_first_chain(d)), "no graph 'nope'"),
    (lambda d: _first_chain(d).pop(), "one part per layer group"),
    (lambda d: _first_chain(d)[0].pop("sha256"), "malformed part entry"),
    (lambda d: _first_chain(d)[1].update(ar=3), "malformed part entry"),  # context != past_len + ar
    (lambda d: _first_chain(d)[1].update(ar=3, context=_first_chain(d)[1]["past_len"] + 3), "shape differs"),
    (lambda d: _old_with_extra(d, dynamic_past="no"), "dynamic_past must be true or false"),
    (lambda d: d.update(custom_ops="staticlm"), "custom_ops must be a list of names"),
    (lambda d: d.update(custom_ops=["ai.other"]), "ops of 'ai.other', which this staticlm does not have"),
    (lambda d: _old_with_extra(d, parts={"layers": [[0, 2]], "graphs": {"nope": []}}), "no graph 'nope'"),
])
def test_malformed_fields_are_refused_in_one_line(family_copy, corrupt, words):
    data = _data(family_copy)
    corrupt(data)
    _write(family_copy, data)
    with pytest.raises(ManifestError, match=words) as e:
        load_manifest(family_copy)
    assert "\n" not in str(e.value)


def test_a_malformed_field_is_one_line_from_the_cli(family_copy):
    data = _data(family_copy)
    data["parts"]["layers"] = [[0, 5]]
    _write(family_copy, data)
    assert_one_line_error(staticlm("generate", "--model", family_copy, "--prompt", "hi", "--device", "cpu"),
                          "parts.layers", "covering layers 0..2")


def test_custom_ops_are_read_and_a_version_5_manifest_has_none(family_copy):
    data = _data(family_copy)
    data["custom_ops"] = ["staticlm"]
    _write(family_copy, data)
    assert load_manifest(family_copy).custom_ops == ("staticlm",)
    del data["custom_ops"]
    _write(family_copy, {**data, "format_version": 5})
    assert load_manifest(family_copy).custom_ops == ()


def test_an_in_place_cpu_family_before_the_split_rope_is_refused_in_one_line(family_copy):
    """Its in-place graphs read a stored RoPE table whose rows differ in their last bits from the host's rows, which
    its segmented graphs take: refused, asking to re-export. Other families of that version still load."""
    data = _data(family_copy)
    _write(family_copy, {**data, "format_version": IN_PLACE_ROPE_VERSION - 1})
    assert load_manifest(family_copy).format_version == IN_PLACE_ROPE_VERSION - 1  # a per-head family: as before
    _write(family_copy, {**data, "format_version": IN_PLACE_ROPE_VERSION - 1, "kv_layout": "in_place"})
    with pytest.raises(ManifestError, match="re-export"):
        load_manifest(family_copy)
    assert_one_line_error(staticlm("generate", "--model", family_copy, "--prompt", "hi", "--device", "cpu"),
                          "--target cpu family", "re-export the model")
    _write(family_copy, {**data, "format_version": IN_PLACE_ROPE_VERSION, "kv_layout": "in_place"})
    assert load_manifest(family_copy).kv_layout.value == "in_place"
