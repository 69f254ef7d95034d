"""Join tokens: signed, expiring, bound to one run."""

import pytest

from elastic_mesh.control.token import (
    TokenError,
    create_token,
    read_token,
    verify_token,
)

SECRET = bytes(range(32))


def test_valid_token_names_the_coordinator():
    token = create_token(SECRET, "10.0.0.1:29400", "run-a", ttl_s=60)
    parsed = verify_token(SECRET, "run-a", token)
    assert parsed.coordinator == "10.0.0.1:29400" and parsed.run_id == "run-a"
    assert read_token(token).coordinator == "10.0.0.1:29400"


def test_forged_signature():
    token = create_token(b"x" * 32, "10.0.0.1:29400", "run-a", ttl_s=60)
    with pytest.raises(TokenError, match="forged or altered"):
        verify_token(SECRET, "run-a", token)


def test_altered_payload():
    prefix, body, signature = create_token(SECRET, "h:1", "run-a", ttl_s=60).split(".")
    other = create_token(SECRET, "h:1", "run-a", ttl_s=10**6).split(".")[1]
    with pytest.raises(TokenError, match="forged or altered"):
        verify_token(SECRET, "run-a", f"{prefix}.{other}.{signature}")


def test_expired():
    token = create_token(SECRET, "h:1", "run-a", ttl_s=-1)
    with pytest.raises(TokenError, match="expired"):
        verify_token(SECRET, "run-a", token)


def test_foreign_run_learns_nothing():
    token = create_token(b"y" * 32, "h:1", "run-b", ttl_s=60)
    with pytest.raises(TokenError) as err:
        verify_token(SECRET, "run-a", token)
    assert "another run" in str(err.value) and "run-a" not in str(err.value)


@pytest.mark.parametrize("garbage", ["", "hello", "prime1.%%%.x", "prime1.e30.abc", "a.b.c.d"])
def test_garbage(garbage):
    with pytest.raises(TokenError, match="not a prime join token"):
        verify_token(SECRET, "run-a", garbage)


def test_attributes_are_signed_bounded_and_read_back():
    token = create_token(SECRET, "h:1", "run-a", ttl_s=60, role="worker", attributes={"dtype": "bfloat16"})
    assert verify_token(SECRET, "run-a", token).attributes == {"dtype": "bfloat16"}
    assert read_token(create_token(SECRET, "h:1", "run-a", ttl_s=60)).attributes == {}
    # A holder that rewrites its attributes (float32 -> bfloat16) breaks the signature.
    import base64
    import json
    prefix, body, signature = token.split(".")
    fields = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    fields["attributes"] = {"dtype": "float32"}
    forged = base64.urlsafe_b64encode(json.dumps(fields, sort_keys=True).encode()).rstrip(b"=").decode()
    with pytest.raises(TokenError, match="forged or altered"):
        verify_token(SECRET, "run-a", f"{prefix}.{forged}.{signature}")
    for bad in ({"Dtype": "x"}, {"dtype": "a b"}, {"dtype": ""}, {f"k{i}": "v" for i in range(9)}, {"dtype": 1}):
        with pytest.raises(ValueError):
            create_token(SECRET, "h:1", "run-a", ttl_s=60, attributes=bad)
