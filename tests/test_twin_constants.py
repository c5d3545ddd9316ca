"""Constants the layer rules force to be written twice (ARCHITECTURE §2): each pair must agree."""

from localtinker.engine.models import TINY_RANDOM_NAME as ENGINE_TINY_RANDOM
from localtinker.engine.packaged import SMOLLM2_NAME
from posttrain.training.config import DEFAULT_BASE_MODEL
from resources.models import TINY_RANDOM_NAME as RESOURCE_TINY_RANDOM
from resources.tinker import DEFAULT_BASE_MODEL as RESOURCE_DEFAULT_BASE_MODEL


def test_the_pipeline_default_base_model_is_the_model_localtinker_ships():
    assert DEFAULT_BASE_MODEL == SMOLLM2_NAME
    assert RESOURCE_DEFAULT_BASE_MODEL is DEFAULT_BASE_MODEL


def test_the_resources_know_the_tiny_random_model_by_the_engine_s_name():
    assert RESOURCE_TINY_RANDOM == ENGINE_TINY_RANDOM
