"""Keys that authenticate a feed's versions: :class:`HmacKey` (a secret shared by the trainer and
its rollouts, HMAC-SHA256) and :class:`Ed25519Key` (the trainer signs with its private key, the
rollouts verify with its public key; ``cryptography``'s Ed25519). A :class:`~jsparse.engine.
Publisher` given a key signs every commit and generation it writes; a
:class:`~jsparse.engine.Subscriber` given a key ignores every commit that is not signed by it,
before reading a part. The checksums inside parts catch damage; only a key stops a writer who
can reach the directory or bucket from forging a version that verifies.

>>> key = HmacKey(b"a secret of 16 bytes or more")
>>> signature = key.sign(b"commit")
>>> key.verify(b"commit", signature), key.verify(b"commit!", signature)
(True, False)
>>> trainer = Ed25519Key.generate()
>>> rollout = Ed25519Key(public_key=trainer.public_bytes())
>>> rollout.verify(b"commit", trainer.sign(b"commit")), rollout.can_sign
(True, False)
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Protocol

from jsparse._src.errors import ArgumentError, ConfigError


class SigningKey(Protocol):
  """What a feed's key does: ``sign`` a message (trainer), ``verify`` a signature (rollout);
  ``algorithm`` and ``key_id`` are written next to each signature."""

  algorithm: str
  key_id: str
  can_sign: bool

  def sign(self, message: bytes) -> bytes: ...
  def verify(self, message: bytes, signature: bytes) -> bool: ...


class HmacKey:
  """HMAC-SHA256 with a shared secret (at least 16 bytes): the trainer and every rollout hold
  the same key, so any holder can sign.

  Args:
    secret: the shared secret (``bytes``; e.g. 32 random bytes kept in a secret manager).

  >>> key = HmacKey(b"0123456789abcdef")
  >>> key.verify(b"a commit", key.sign(b"a commit")), key.can_sign
  (True, True)
  """

  algorithm = "hmac-sha256"
  can_sign = True

  def __init__(self, secret: bytes):
    if not isinstance(secret, (bytes, bytearray)):
      raise ArgumentError(f"HmacKey needs the secret as bytes, got {type(secret).__name__}")
    if len(secret) < 16:
      raise ConfigError(f"an HMAC secret of {len(secret)} bytes is too short (at least 16)")
    self._secret = bytes(secret)
    self.key_id = hashlib.sha256(b"jsparse-hmac-key-id" + self._secret).hexdigest()[:16]

  def sign(self, message: bytes) -> bytes:
    return hmac.new(self._secret, message, hashlib.sha256).digest()

  def verify(self, message: bytes, signature: bytes) -> bool:
    return hmac.compare_digest(self.sign(message), bytes(signature))

  def __repr__(self) -> str:
    return f"HmacKey(key_id={self.key_id!r})"


class Ed25519Key:
  """An Ed25519 key pair, or only its public half: the trainer holds the private key and signs;
  rollouts hold the public key and verify (they cannot sign).

  Args:
    private_key: the 32 raw bytes of the private key, or a ``cryptography`` ``Ed25519PrivateKey``.
    public_key: the 32 raw bytes of the public key, or an ``Ed25519PublicKey`` (derived from the
      private key when that is given).

  >>> trainer = Ed25519Key.generate()  # its private key stays with the trainer
  >>> rollout = Ed25519Key(public_key=trainer.public_bytes())
  >>> rollout.verify(b"a commit", trainer.sign(b"a commit")), rollout.key_id == trainer.key_id
  (True, True)
  """

  algorithm = "ed25519"

  def __init__(self, private_key=None, public_key=None):
    from cryptography.hazmat.primitives.asymmetric import ed25519
    if private_key is None and public_key is None:
      raise ConfigError("Ed25519Key needs a private key (to sign) or a public key (to verify)")
    if isinstance(private_key, (bytes, bytearray)):
      private_key = ed25519.Ed25519PrivateKey.from_private_bytes(bytes(private_key))
    if private_key is not None and not isinstance(private_key, ed25519.Ed25519PrivateKey):
      raise ArgumentError("Ed25519Key's private_key: 32 bytes or an Ed25519PrivateKey, got "
                          f"{type(private_key).__name__}")
    if isinstance(public_key, (bytes, bytearray)):
      public_key = ed25519.Ed25519PublicKey.from_public_bytes(bytes(public_key))
    if public_key is None:
      public_key = private_key.public_key()
    if not isinstance(public_key, ed25519.Ed25519PublicKey):
      raise ArgumentError("Ed25519Key's public_key: 32 bytes or an Ed25519PublicKey, got "
                          f"{type(public_key).__name__}")
    if private_key is not None and _raw(private_key.public_key()) != _raw(public_key):
      raise ConfigError("Ed25519Key: the public key is not the private key's")
    self._private, self._public = private_key, public_key
    self.can_sign = private_key is not None
    self.key_id = hashlib.sha256(_raw(public_key)).hexdigest()[:16]

  @classmethod
  def generate(cls) -> "Ed25519Key":
    """A new random key pair."""
    from cryptography.hazmat.primitives.asymmetric import ed25519
    return cls(ed25519.Ed25519PrivateKey.generate())

  def public_bytes(self) -> bytes:
    """The 32 raw bytes of the public key (what rollouts are given)."""
    return _raw(self._public)

  def sign(self, message: bytes) -> bytes:
    if self._private is None:
      raise ConfigError("this Ed25519Key holds only a public key: it verifies, it cannot sign "
                        "(give the Publisher the private key)")
    return self._private.sign(bytes(message))

  def verify(self, message: bytes, signature: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature
    try:
      self._public.verify(bytes(signature), bytes(message))
      return True
    except (InvalidSignature, ValueError):
      return False

  def __repr__(self) -> str:
    return f"Ed25519Key(key_id={self.key_id!r}, can_sign={self.can_sign})"


def _raw(public_key) -> bytes:
  from cryptography.hazmat.primitives import serialization
  return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_argument(name: str, key) -> SigningKey | None:
  """``key`` checked to be a feed key (or None)."""
  if key is None:
    return None
  if not all(hasattr(key, a) for a in ("sign", "verify", "algorithm", "key_id")):
    raise ArgumentError(f"{name}: expected a jsparse.engine.HmacKey or Ed25519Key (or None), "
                        f"got {type(key).__name__}")
  return key
