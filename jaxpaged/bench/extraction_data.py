"""The clinical-notes extraction workload of `jaxpaged bench extraction` (no JAX here).

Every request is one shared prefix (an instruction and few-shot examples, `prefix_len` tokens,
the same ids for every request so prefix caching computes it once), then a note of its own
(`note_len` tokens drawn in a range), then the answer cue. The output is asked to follow
`SCHEMA`: a dozen fields of mixed types (integers with ranges, enums, booleans, nullable
integers, bounded strings, arrays of strings and of objects), every string and array bounded so
that a document that follows the schema ends within `output_len` tokens.

Notes are synthetic (sentences built from a fixed clinical word list with a seeded generator),
so runs are repeatable and nothing comes from a hub; their content does not matter to a model
with random or toy weights, their lengths do.
"""

import json
import random

SCHEMA: dict = {
    "type": "object",
    "properties": {
        "patient_age": {"type": "integer", "minimum": 0, "maximum": 120},
        "sex": {"enum": ["female", "male", "other", "unknown"]},
        "chief_complaint": {"type": "string", "maxLength": 60},
        "diagnoses": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4},
        "medications": {
            "type": "array",
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "dose_mg": {"type": "integer", "minimum": 0, "maximum": 5000},
                    "route": {"enum": ["oral", "iv", "im", "topical", "inhaled"]},
                },
                "required": ["name", "dose_mg", "route"],
                "additionalProperties": False,
            },
        },
        "allergies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
        "smoker": {"type": "boolean"},
        "systolic_bp": {"type": ["integer", "null"], "minimum": 40, "maximum": 260},
        "heart_rate": {"type": ["integer", "null"], "minimum": 20, "maximum": 250},
        "severity": {"enum": ["mild", "moderate", "severe", "critical"]},
        "follow_up_days": {"type": "integer", "minimum": 0, "maximum": 365},
        "admitted": {"type": "boolean"},
    },
    "required": [
        "patient_age",
        "sex",
        "chief_complaint",
        "diagnoses",
        "medications",
        "allergies",
        "smoker",
        "systolic_bp",
        "heart_rate",
        "severity",
        "follow_up_days",
        "admitted",
    ],
    "additionalProperties": False,
}

INSTRUCTION = (
    "You are a clinical documentation assistant. Read the clinical note below and extract the "
    "requested fields as one JSON object that follows this schema exactly, with no text before or "
    "after it. Use null for a vital sign the note does not state. List at most four diagnoses, four "
    "medications with their dose in milligrams and their route, and three allergies. Severity is the "
    "clinician's overall assessment. Follow-up is in days from the visit.\nSchema: "
    + json.dumps(SCHEMA, separators=(",", ":"))
)

EXAMPLES = (
    (
        "Note: 67 year old male presents with chest pain radiating to the left arm for two hours. "
        "History of hypertension and type 2 diabetes. Takes metformin 1000 mg by mouth twice daily and "
        "lisinopril 20 mg daily. Allergic to penicillin. Smokes one pack per day. BP 162/95, HR 104. "
        "Troponin elevated. Admitted to cardiology for acute coronary syndrome. Follow up in 14 days.",
        {
            "patient_age": 67,
            "sex": "male",
            "chief_complaint": "chest pain radiating to left arm",
            "diagnoses": ["acute coronary syndrome", "hypertension", "type 2 diabetes"],
            "medications": [
                {"name": "metformin", "dose_mg": 1000, "route": "oral"},
                {"name": "lisinopril", "dose_mg": 20, "route": "oral"},
            ],
            "allergies": ["penicillin"],
            "smoker": True,
            "systolic_bp": 162,
            "heart_rate": 104,
            "severity": "severe",
            "follow_up_days": 14,
            "admitted": True,
        },
    ),
    (
        "Note: 24 year old female with three days of sore throat and low grade fever. No known drug "
        "allergies. Non smoker. Rapid strep positive. Started amoxicillin 500 mg orally three times "
        "daily for ten days. Vitals not recorded. Discharged home, return if worse.",
        {
            "patient_age": 24,
            "sex": "female",
            "chief_complaint": "sore throat and fever",
            "diagnoses": ["streptococcal pharyngitis"],
            "medications": [{"name": "amoxicillin", "dose_mg": 500, "route": "oral"}],
            "allergies": [],
            "smoker": False,
            "systolic_bp": None,
            "heart_rate": None,
            "severity": "mild",
            "follow_up_days": 10,
            "admitted": False,
        },
    ),
)

_WORDS = (
    "patient reports denies history of acute chronic pain fever cough dyspnea nausea vomiting "
    "abdominal chest headache dizziness fatigue edema rash wound infection fracture hypertension "
    "diabetes asthma copd heart failure atrial fibrillation stroke sepsis pneumonia anemia kidney "
    "liver thyroid started continued stopped increased decreased dose daily twice nightly as needed "
    "mg oral iv topical inhaled allergy penicillin sulfa latex smoker alcohol exam normal tender "
    "swollen clear bilateral left right lower upper vitals stable afebrile tachycardic hypotensive "
    "labs elevated within limits imaging negative positive plan admit discharge follow up clinic "
    "days weeks months return precautions reviewed counseled"
).split()


def prefix_text() -> str:
    """The instruction and the few-shot examples every request shares."""
    shots = "".join(f"\n{note}\nJSON: {json.dumps(answer, separators=(',', ':'))}\n" for note, answer in EXAMPLES)
    return f"{INSTRUCTION}\n{shots}"


def note_text(rng: random.Random, words: int) -> str:
    """A synthetic note of about `words` words, in sentences."""
    out, n = [], 0
    while n < words:
        k = rng.randint(6, 16)
        sentence = " ".join(rng.choice(_WORDS) for _ in range(k))
        out.append(sentence[0].upper() + sentence[1:] + ".")
        n += k
    return " ".join(out)


def extraction_prompts(
    tokenizer, num_prompts: int, prefix_len: int, note_len: tuple[int, int], seed: int
) -> list[list[int]]:
    """`num_prompts` prompts as token ids: the shared prefix cut or repeated to exactly
    `prefix_len` tokens, a note of `note_len[0]..note_len[1]` tokens, then the answer cue.

    Args:
      tokenizer: a Hugging Face tokenizer (its ids must be the model's).
    """
    rng = random.Random(seed)
    shared = tokenizer.encode(prefix_text())
    while len(shared) < prefix_len:  # a long instruction for a model with a short one: repeat the examples
        shared += tokenizer.encode(prefix_text(), add_special_tokens=False)
    shared = shared[:prefix_len]
    cue = tokenizer.encode("\nJSON: ", add_special_tokens=False)
    prompts = []
    for _ in range(num_prompts):
        length = rng.randint(*note_len)
        note: list[int] = []
        while len(note) < length:
            note += tokenizer.encode(" Note: " + note_text(rng, length), add_special_tokens=False)
        prompts.append(shared + note[:length] + cue)
    return prompts


def is_valid(text: str) -> bool:
    """Whether `text` is one JSON document that `SCHEMA` accepts."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True
