"""The vision tower runs in the engine's step (issue 27): jobs carry their images prepared (pixels and
content keys, engine/vision/images.py) and the generator encodes the images of every job admitted in a
step in one forward of the real tower (counted with a forward hook), an image once however many jobs
hold it; the tokens equal transformers' generate; a job whose image the tower cannot take fails alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from engine import FinishReason, Job
from engine.vision.images import ImageEncoder, PendingImage, expand_image_placeholders
from tests.engine_runs import run
from tests.test_image_jobs import NEW_TOKENS, generator_for, hf_generate, make_images, vision_of


def count_tower_forwards(vision: ImageEncoder) -> list[int]:
    """The batch size of every forward of the real tower module, from a forward hook."""
    calls: list[int] = []
    vision.tower.register_forward_hook(lambda module, args, output: calls.append(args[0].shape[0]))
    return calls


def image_job(vision: ImageEncoder, name: str, ids: list[int], embeddings: list[PendingImage]) -> Job:
    return Job(expand_image_placeholders(ids, embeddings, vision.image_token_id), NEW_TOKENS, stop_conditions=[],
               embeddings=embeddings, identifier=name)


def test_the_images_of_a_steps_admissions_go_through_the_tower_in_one_forward(llava_dir: Path, hf_llava: Any):
    generator = generator_for(llava_dir, max_chunk_size=256)
    vision = vision_of(generator)
    calls = count_tower_forwards(vision)
    image = vision.image_token_id
    first, second, third = make_images(3, seed=7)
    prompts = {"a": ([5, 6, image, 7], [first]), "b": ([8, image, 9, image, 10], [second, first.copy()]),
               "c": ([11, image, 12], [third]), "d": ([13, 14, image], [second.copy()]), "text": ([20, 21, 22], [])}
    jobs = [image_job(vision, name, ids, vision.prepare(images)) for name, (ids, images) in prompts.items()]
    assert calls == [] and not any(e.encoded for job in jobs for e in job.embeddings)
    generator.enqueue(jobs)
    generator.iterate()
    assert generator.num_active_jobs() == len(jobs)  # every job admitted in that one step
    assert calls == [3]  # one forward for the step's admissions, one row per distinct image
    results = run(generator, [])
    expected = {name: hf_generate(hf_llava, vision, ids, images) for name, (ids, images) in prompts.items()}
    assert {name: result.completion_ids for name, result in results.items()} == expected
    assert calls == [3] and (vision.tower_batches, vision.images_encoded) == (1, 3)


def test_an_image_a_live_job_holds_is_taken_from_it_not_encoded_again(llava_dir: Path):
    generator = generator_for(llava_dir, max_chunk_size=256)
    vision = vision_of(generator)
    calls = count_tower_forwards(vision)
    image = vision.image_token_id
    (picture,) = make_images(1, seed=9)
    generator.enqueue(image_job(vision, "first", [5, image, 6], vision.prepare([picture])))
    generator.iterate()
    assert calls == [1]
    later = image_job(vision, "later", [7, image, 8], vision.prepare([picture.copy()]))
    results = run(generator, [later])
    assert calls == [1] and set(results) == {"first", "later"}
    assert later.embeddings[0].vectors is results["first"].job.embeddings[0].vectors  # the encoder cache's


def test_a_job_whose_image_the_tower_cannot_take_fails_alone(llava_dir: Path, hf_llava: Any):
    """An image of the wrong size (pixels no processor of this model gives) breaks the step's tower call;
    each job's images are then encoded alone, and only that job ends, with the tower's error."""
    generator = generator_for(llava_dir, max_chunk_size=256)
    vision = vision_of(generator)
    calls = count_tower_forwards(vision)
    image = vision.image_token_id
    (picture,) = make_images(1, seed=11)
    wrong = np.zeros((3, 8, 8), dtype=np.float32)
    broken = PendingImage(wrong, vision.key(wrong), vision)
    results = run(generator, [image_job(vision, "good", [5, image, 6], vision.prepare([picture])),
                              image_job(vision, "broken", [7, image, 8], [broken])])
    assert results["broken"].eos_reason == FinishReason.ERROR
    assert (results["broken"].error or "").startswith("embeddings: encoding failed: ValueError: pixel values must be")
    assert results["good"].completion_ids == hf_generate(hf_llava, vision, [5, image, 6], [picture])
    assert calls == [1]  # the good job's image alone: the batch and the broken image failed before the hook
    assert generator.pool.num_free == generator.pool.num_pages
