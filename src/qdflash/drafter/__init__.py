"""The DFlash drafter: model, training layout, acceptance (contract: load_drafter / init_drafter)."""

from .model import Drafter, DrafterConfig, init_drafter, load_drafter, save_drafter

__all__ = ["Drafter", "DrafterConfig", "init_drafter", "load_drafter", "save_drafter"]
