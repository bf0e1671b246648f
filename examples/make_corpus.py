"""Generate `vaswani/data/corpus.txt`: short children's stories written by a small random grammar.

The corpus is original text, made here from a few hundred words and a dozen story shapes, so the package
ships training data with no licence question and no download. It is deterministic: the same seed gives the
same bytes. Stories are separated by a blank line.

    python examples/make_corpus.py                       # writes vaswani/data/corpus.txt (about 450 KB)
    python examples/make_corpus.py --kilobytes 100 --seed 1 --output /tmp/corpus.txt

The text is simple on purpose: a tiny language model trained on it for a minute on a CPU learns to write
phrases like "Once upon a time, there was a little fox named Pip." that are easy to judge by eye.
"""

import argparse
import random
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

# ------------------------------------------------------------------------------------------------ vocabulary


def words(text: str) -> list[str]:
    """The whitespace-separated words of `text`."""
    return text.split()


def phrases(text: str) -> list[str]:
    """The non-empty lines of `text`, stripped."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def pairs(text: str) -> list[tuple[str, ...]]:
    """Lines of `text` split on " / ": one tuple per line."""
    return [tuple(part.strip() for part in line.split(" / ")) for line in phrases(text)]


GIRL_NAMES = words("Mia Lily Anna Zoe Nora Ruby Ella Ivy Rosa Maya Lucy Sara Emma Tess Ada June Hana Lena Pia Clara")
BOY_NAMES = words("Tom Ben Sam Max Leo Finn Jack Omar Theo Kai Noah Hugo Eli Otto Ravi Luca Dan Pete Milo Jonas")
PET_NAMES = words("Pip Bobo Dot Fluff Nib Tiko Puddle Bean Sunny Pebble Button Moss Biscuit Twig Maple Hazel")

PEOPLE = words("girl boy")
ANIMALS = words(
    "fox rabbit bear cat dog duck mouse owl frog turtle squirrel bird lamb pig goat horse deer hedgehog puppy "
    "kitten bunny hen crab otter"
)
ANIMAL_SOUNDS = dict(
    pair.split(":")
    for pair in words(
        "dog:Woof puppy:Woof cat:Meow kitten:Meow duck:Quack owl:Hoot frog:Ribbit lamb:Baa goat:Baa pig:Oink "
        "hen:Cluck horse:Neigh bird:Tweet mouse:Squeak"
    )
)
TRAITS = words(
    "little brave curious shy kind happy clever sleepy small young gentle busy cheerful funny quiet friendly silly careful proud lonely"
)
HOMES = phrases(
    """
    a small house near the river
    a big green forest
    a quiet village
    a farm on the hill
    a town by the sea
    a garden full of flowers
    a cottage in the woods
    a sunny meadow
    a tall tree by the lake
    a cozy hole under an old oak
    a blue house on a busy street
    a little boat on the river
    a warm barn
    a nest high in the pine tree
    """
)
PLACES = phrases(
    """
    the park
    the pond
    the market
    the beach
    the hill
    the old bridge
    the library
    the bakery
    the forest
    the meadow
    the school
    the lake
    the garden
    the river
    the zoo
    the farm
    the playground
    the cave
    the field
    the town square
    """
)
TIMES = words("morning day evening afternoon weekend summer spring")
ONE_DAY = phrases(
    """
    One day
    One morning
    One sunny afternoon
    One rainy day
    One cold morning
    One warm evening
    Then one day
    Early one morning
    One windy day
    One snowy morning
    """
)
FRIEND_WORDS = phrases(
    """
    friend
    best friend
    little brother
    little sister
    grandma
    grandpa
    mom
    dad
    neighbor
    cousin
    """
)
# Verb phrases as (base form, past form), so one list serves "liked to ..." and "... played".
ACTIVITIES = pairs(
    """
    play with a ball / played with a ball
    read books / read books
    draw pictures / drew pictures
    sing songs / sang songs
    climb trees / climbed trees
    pick flowers / picked flowers
    build sand castles / built sand castles
    watch the stars / watched the stars
    bake bread / baked bread
    fly a kite / flew a kite
    run in the grass / ran in the grass
    splash in puddles / splashed in puddles
    count the clouds / counted the clouds
    dance in the sun / danced in the sun
    look for shells / looked for shells
    ride a bike / rode a bike
    swim in the lake / swam in the lake
    jump over rocks / jumped over rocks
    plant seeds / planted seeds
    feed the ducks / fed the ducks
    play hide and seek / played hide and seek
    tell jokes / told jokes
    make paper boats / made paper boats
    collect leaves / collected leaves
    paint with bright colors / painted with bright colors
    listen to the birds / listened to the birds
    """
)
OBJECTS = phrases(
    """
    ball
    kite
    box
    book
    hat
    key
    shell
    stone
    cup
    map
    lamp
    bell
    feather
    apple
    cookie
    blanket
    toy boat
    balloon
    paintbrush
    basket
    scarf
    drum
    sock
    coin
    ring
    teddy bear
    flower
    whistle
    jar
    pencil
    sandwich
    umbrella
    """
)
OBJECT_LOOKS = words(
    "red blue green yellow shiny tiny old big soft round purple striped golden orange pink new funny heavy light bright"
)
HIDING_PLACES = phrases(
    """
    under a big leaf
    behind a rock
    in the tall grass
    near the old tree
    under the bench
    inside a hollow log
    next to the pond
    on top of a hill
    under the bed
    in a bush
    by the fence
    under a pile of leaves
    in the sand
    behind the barn
    beside the path
    """
)
SEARCH_PLACES = phrases(
    """
    under the tree
    behind the rocks
    in the bushes
    by the river
    near the flowers
    under the bridge
    in the tall grass
    around the house
    along the path
    in the garden
    """
)
FEELINGS = words("happy sad scared excited tired hungry proud surprised worried angry calm glad")
COUNTABLE_FOODS = words("apples carrots cookies berries pancakes nuts plums cherries muffins")
FOODS = COUNTABLE_FOODS + words("bread soup cheese honey cake pie rice corn")
# (what happens, the kind of day)
WEATHER = pairs(
    """
    the sun was hot / sunny
    the sky was gray / cloudy
    it began to rain / rainy
    the wind blew hard / windy
    snow fell softly / snowy
    the air was warm / warm
    """
)
# (thing, made of, made at)
THINGS_TO_MAKE = pairs(
    """
    sand castle / sand / the beach
    snowman / snow / the field
    tree house / wood / the garden
    cake / flour and eggs / the kitchen
    paper boat / paper / the river
    bird house / wood and nails / the garden
    kite / paper and string / the hill
    necklace / shells and string / the beach
    little boat / sticks and leaves / the pond
    picture / crayons / the table
    robot / boxes and tape / the garage
    scarecrow / straw and old clothes / the field
    """
)
MORALS = phrases(
    """
    it is good to help a friend
    friends make every day better
    being kind is always the right choice
    you should never give up
    sharing makes everyone happy
    it is okay to ask for help
    being brave does not mean you are not scared
    working together makes hard things easy
    a little patience goes a long way
    it is fun to try new things
    telling the truth is important
    home is where your friends are
    small friends can do big things
    """
)
# (animals, three things true of them)
FACT_SUBJECTS = pairs(
    """
    Birds / can fly / build nests in trees / eat seeds and worms
    Fish / can swim / live in water / have fins and scales
    Cats / like to sleep / have soft fur / drink milk
    Dogs / like to run / wag their tails / can smell many things
    Bees / make honey / visit flowers / live in a hive
    Frogs / can jump far / live near ponds / say ribbit
    Owls / wake up at night / have big eyes / can turn their heads
    Rabbits / eat carrots / have long ears / hop very fast
    Trees / grow tall / have green leaves / give us shade
    Bears / sleep in winter / love honey / are very strong
    Ducks / can swim and fly / say quack / like the water
    Squirrels / hide nuts / climb trees / have bushy tails
    """
)
FACT_GENERAL = phrases(
    """
    The sun is hot and bright.
    The moon comes out at night.
    Rain helps the plants grow.
    Snow is cold and white.
    The sky is blue on a sunny day.
    Stars shine in the dark sky.
    Flowers need sun and water.
    The sea is big and deep.
    Leaves fall from the trees in autumn.
    In spring, the flowers open.
    Winter is the coldest time of the year.
    Summer days are long and warm.
    A rainbow has many colors.
    Clouds are made of tiny drops of water.
    """
)
NUMBERS = words("two three four five six seven eight nine ten")

# -------------------------------------------------------------------------------------------------- characters


@dataclass
class Character:
    name: str
    kind: str  # "girl", "fox", ...
    trait: str
    subject: str  # "she"
    object: str  # "her"
    possessive: str  # "her"

    @property
    def called(self) -> str:
        """How the story names this character when it appears: "Mia", or "Pip the fox"."""
        return self.name if self.kind in PEOPLE else f"{self.name} the {self.kind}"

    @property
    def He(self) -> str:  # noqa: N802 - sentence-initial pronoun reads best at the call site
        return self.subject.capitalize()

    @property
    def His(self) -> str:  # noqa: N802
        return self.possessive.capitalize()


def make_character(rng: random.Random, avoid: Collection[str] = ()) -> Character:
    """A named girl, boy or animal, with matching pronouns."""
    kind = rng.choice(PEOPLE) if rng.random() < 0.4 else rng.choice(ANIMALS)
    female = kind == "girl" or (kind != "boy" and rng.random() < 0.5)
    if kind in PEOPLE:
        pool = GIRL_NAMES if female else BOY_NAMES
    else:
        pool = PET_NAMES + (GIRL_NAMES if female else BOY_NAMES)
    name = rng.choice([n for n in pool if n not in avoid])
    pronouns = ("she", "her", "her") if female else ("he", "him", "his")
    return Character(name, kind, rng.choice(TRAITS), *pronouns)


def a(word: str) -> str:
    """The word with its indefinite article."""
    return ("an " if word[0] in "aeiou" else "a ") + word


def say(rng: random.Random, speaker: Character, line: str) -> str:
    """One line of dialogue with a varied tag, e.g. '"Hello," said Mia.'"""
    verb = rng.choice(["said", "said", "said", "asked" if line.endswith("?") else "answered", "whispered"])
    if line.endswith(("?", "!")):
        return f'"{line}" {verb} {speaker.name}.'
    return f'"{line}," {verb} {speaker.name}.'


# ------------------------------------------------------------------------------------------------ story shapes


def opening(rng: random.Random, hero: Character) -> list[str]:
    home = rng.choice(HOMES)
    lines = rng.choice(
        [
            [
                f"Once upon a time, there was {a(hero.trait)} {hero.kind} named {hero.name}.",
                f"{hero.He} lived in {home}.",
            ],
            [f"{hero.name} was {a(hero.trait)} {hero.kind} who lived in {home}."],
            [f"In {home}, there lived {a(hero.trait)} {hero.kind} called {hero.name}."],
            [
                f"There once was {a(hero.trait)} {hero.kind}. {hero.His} name was {hero.name}.",
                f"{hero.He} lived in {home}.",
            ],
        ]
    )
    base, _ = rng.choice(ACTIVITIES)
    lines.append(
        rng.choice(
            [
                f"Every {rng.choice(TIMES)}, {hero.subject} liked to {base}.",
                f"{hero.He} loved to {base} with {hero.possessive} {rng.choice(FRIEND_WORDS)}.",
                f"More than anything, {hero.name} liked to {base}.",
            ]
        )
    )
    return lines


def lost_thing_story(rng: random.Random) -> list[str]:
    hero = make_character(rng)
    friend = make_character(rng, avoid={hero.name})
    thing = f"{rng.choice(OBJECT_LOOKS)} {rng.choice(OBJECTS)}"
    place = rng.choice(PLACES)
    found_at = rng.choice(HIDING_PLACES)
    lines = opening(rng, hero)
    lines.append(f"{rng.choice(ONE_DAY)}, {hero.name} went to {place}.")
    lines.append(f"There, {hero.subject} saw {a(friend.kind)} named {friend.name}. {friend.name} looked very sad.")
    lines.append(say(rng, hero, rng.choice(["Why are you sad?", "What is wrong?", "Are you okay?"])))
    lines.append(say(rng, friend, f"I lost my {thing}. I cannot find it anywhere"))
    lines.append(
        say(
            rng,
            hero,
            rng.choice(
                [
                    "Do not worry. I will help you",
                    "Let us look for it together",
                    "I am good at finding things. I will help you",
                ]
            ),
        )
    )
    searched = rng.sample(SEARCH_PLACES, 2)
    lines.append(f"They looked {searched[0]}. They looked {searched[1]}. But the {thing} was not there.")
    if rng.random() < 0.5:
        lines.append(f'{friend.name} started to cry, but {hero.name} said, "We will not give up!"')
    lines.append(f"At last, {hero.name} saw something {found_at}. It was the {thing}!")
    lines.append(
        f'{friend.name} was so {rng.choice(["happy", "glad", "excited"])}. "Thank you, {hero.name}!" '
        f"{friend.subject} said."
    )
    lines.append(
        rng.choice(
            [
                f"From that day on, {hero.name} and {friend.name} were best friends.",
                f"Then they {rng.choice(ACTIVITIES)[1]} together until the sun went down.",
                f"{hero.name} learned that {rng.choice(MORALS)}.",
            ]
        )
    )
    return lines


def weather_story(rng: random.Random) -> list[str]:
    hero = make_character(rng)
    base, past = rng.choice(ACTIVITIES)
    event, kind = rng.choice(WEATHER[1:])
    lines = opening(rng, hero)
    lines.append(f"{rng.choice(ONE_DAY)}, {hero.name} wanted to {base}.")
    lines.append(f"But when {hero.subject} went outside, {event}.")
    lines.append(
        f"{hero.name} felt {rng.choice(['sad', 'grumpy', 'bored', 'upset'])}. "
        f'"I cannot {base} on a {kind} day," {hero.subject} said.'
    )
    helper = rng.choice(["mom", "dad", "grandma", "grandpa", "friend", "big sister", "big brother"])
    idea_base, idea_past = rng.choice([x for x in ACTIVITIES if x[0] != base])
    lines.append(f'{hero.His} {helper} smiled. "Why not {idea_base} instead?"')
    lines.append(f"So {hero.name} {idea_past}. It was more fun than {hero.subject} thought!")
    lines.append(
        rng.choice(
            [
                f"The next day, the weather was nice, and {hero.name} {past} too.",
                f"Later, the sky was clear again. {hero.name} went outside and {past}.",
                f'That night, {hero.name} said, "A {kind} day can be a good day too."',
            ]
        )
    )
    return lines


def making_story(rng: random.Random) -> list[str]:
    hero = make_character(rng)
    friend = make_character(rng, avoid={hero.name})
    thing, material, where = rng.choice(THINGS_TO_MAKE)
    lines = opening(rng, hero)
    lines.append(f"{rng.choice(ONE_DAY)}, {hero.name} wanted to make {a(thing)}.")
    lines.append(f"{hero.He} took some {material} and went to {where}.")
    lines.append(
        f"{hero.He} worked and worked, but it was hard. {hero.His} {thing} "
        f"{rng.choice(['fell down', 'broke', 'did not look right', 'was too small'])}."
    )
    lines.append(f"Just then, {friend.called} came by.")
    lines.append(say(rng, friend, rng.choice(["Can I help?", "What are you making?", "Do you need a hand?"])))
    lines.append(say(rng, hero, f"I want to make {a(thing)}, but it is too hard for me"))
    lines.append(
        say(
            rng,
            friend,
            rng.choice(["Let us do it together", "Two can do more than one", "I will hold it while you work"]),
        )
    )
    lines.append(f"{hero.name} and {friend.name} worked together. Soon, the {thing} was done.")
    lines.append(
        f"It was the {rng.choice(['best', 'biggest', 'most beautiful', 'finest'])} {thing} they had ever seen."
    )
    lines.append(f"{hero.name} learned that {rng.choice(MORALS)}.")
    return lines


def trip_story(rng: random.Random) -> list[str]:
    hero = make_character(rng)
    place = rng.choice(PLACES)
    food = rng.choice(FOODS)
    count = rng.choice(NUMBERS)
    seen = rng.sample(ANIMALS, 3)
    lines = opening(rng, hero)
    lines.append(
        f"{rng.choice(ONE_DAY)}, {hero.name} and {hero.possessive} {rng.choice(FRIEND_WORDS)} went to {place}."
    )
    lines.append(f"They packed a basket with {food} and {rng.choice([f for f in FOODS if f != food])}.")
    lines.append(f"On the way, they saw {a(seen[0])}, {a(seen[1])} and {count} little {seen[2]}s.")
    sound = ANIMAL_SOUNDS.get(seen[0])
    if sound:
        lines.append(f'The {seen[0]} said, "{sound}!" {hero.name} laughed.')
    lines.append(
        f"At {place.removeprefix('the ')}, they sat down and ate the {food}. Then they {rng.choice(ACTIVITIES)[1]}."
    )
    lines.append(f"When the sun went down, {hero.name} was {rng.choice(['tired', 'sleepy', 'happy'])}.")
    lines.append(
        rng.choice(
            [
                f'"This was the best day ever," {hero.subject} said.',
                f"{hero.He} went to bed and dreamed about {place}.",
                f"{hero.He} could not wait to go back to {place} again.",
            ]
        )
    )
    return lines


def fear_story(rng: random.Random) -> list[str]:
    hero = make_character(rng)
    friend = make_character(rng, avoid={hero.name})
    fear = rng.choice(
        [
            "the dark",
            "the big dog next door",
            "the deep water",
            "the loud thunder",
            "the tall slide",
            "the old cave",
            "the new school",
            "the noisy wind",
        ]
    )
    lines = opening(rng, hero)
    lines.append(f"But {hero.name} had a secret. {hero.He} was scared of {fear}.")
    lines.append(f"{rng.choice(ONE_DAY)}, {hero.name} had to face {fear}.")
    lines.append(f'{hero.His} legs shook. "I am too scared," {hero.subject} whispered.')
    lines.append(f"{friend.called} held {hero.possessive} hand.")
    lines.append(
        say(
            rng,
            friend,
            rng.choice(
                ["I am here with you", "You are braver than you think", "Take a deep breath. We can do it together"]
            ),
        )
    )
    lines.append(
        f"{hero.name} took a deep breath and {rng.choice(['stepped forward', 'opened the door', 'looked up'])}."
    )
    lines.append(f"It was not so bad after all! {hero.name} felt {rng.choice(['proud', 'brave', 'strong', 'glad'])}.")
    lines.append(f"{hero.name} learned that {rng.choice(MORALS)}.")
    return lines


def sharing_story(rng: random.Random) -> list[str]:
    hero = make_character(rng)
    others = [make_character(rng, avoid={hero.name}) for _ in range(2)]
    food = rng.choice(COUNTABLE_FOODS)
    count = rng.choice(NUMBERS[1:])
    lines = opening(rng, hero)
    lines.append(
        f"{rng.choice(ONE_DAY)}, {hero.name} found {count} {food} "
        f"{rng.choice(['on the table', 'in a basket', 'under a tree', 'in the kitchen'])}."
    )
    lines.append(f"{hero.He} wanted to eat them all by {hero.object}self.")
    lines.append(
        f"Then {hero.subject} saw {others[0].name} and {others[1].name}. They looked "
        f"{rng.choice(['hungry', 'tired', 'sad'])}."
    )
    lines.append(f'{hero.name} thought for a moment. Then {hero.subject} said, "Would you like some {food}?"')
    lines.append(say(rng, others[0], rng.choice(["Yes, please!", "Oh, thank you!", "That is so kind!"])))
    lines.append(f"They shared the {food} and {rng.choice(ACTIVITIES)[1]} together.")
    lines.append(f"{hero.name} felt warm and {rng.choice(['happy', 'glad', 'proud'])} inside.")
    lines.append(f"{hero.He} learned that {rng.choice(MORALS)}.")
    return lines


def conversation(rng: random.Random) -> list[str]:
    first = make_character(rng)
    second = make_character(rng, avoid={first.name})
    feeling = rng.choice(FEELINGS)
    base, past = rng.choice(ACTIVITIES)
    place = rng.choice(PLACES)
    return [
        say(rng, first, f"Hello, {second.name}! How are you today?"),
        say(rng, second, f"I am {feeling}. Yesterday I went to {place} and {past}"),
        say(
            rng,
            first,
            rng.choice(
                [
                    "Can I come with you next time?",
                    "That sounds like fun!",
                    f"Did you see anything nice at {place.removeprefix('the ')}?",
                ]
            ),
        ),
        say(
            rng,
            second,
            rng.choice(
                [
                    f"Yes! Let us go tomorrow and {base} together",
                    f"I saw {a(rng.choice(OBJECT_LOOKS))} {rng.choice(OBJECTS)}",
                    f"Of course. We can bring some {rng.choice(FOODS)}",
                ]
            ),
        ),
        f"{first.name} and {second.name} smiled. They were good friends.",
    ]


def facts(rng: random.Random) -> list[str]:
    subject, *properties = rng.choice(FACT_SUBJECTS)
    rng.shuffle(properties)
    lines = [
        f"{subject} {properties[0]}.",
        f"{subject} also {properties[1]}.",
        f"Did you know that {subject.lower()} {properties[2]}?",
    ]
    lines += rng.sample(FACT_GENERAL, 2)
    return lines


STORY_SHAPES = [
    (lost_thing_story, 4),
    (weather_story, 3),
    (making_story, 3),
    (trip_story, 3),
    (fear_story, 2),
    (sharing_story, 2),
    (conversation, 2),
    (facts, 1),
]


def generate_corpus(kilobytes: int = 450, seed: int = 0) -> str:
    """Stories separated by blank lines until the text reaches `kilobytes` KB; deterministic for a given seed."""
    rng = random.Random(seed)
    shapes, weights = zip(*STORY_SHAPES)
    stories: list[str] = []
    size = 0
    while size < kilobytes * 1000:
        story = " ".join(rng.choices(shapes, weights)[0](rng))
        stories.append(story)
        size += len(story) + 2
    return "\n\n".join(stories) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kilobytes", type=int, default=450, help="approximate size of the corpus")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path(__file__).resolve().parents[1] / "vaswani/data/corpus.txt")
    args = parser.parse_args()
    text = generate_corpus(args.kilobytes, args.seed)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    tokens = text.split()
    vocabulary = {w.strip('.,!?"').lower() for w in tokens}
    print(
        f"wrote {args.output}: {len(text) / 1000:.0f} KB, {text.count(chr(10) * 2) + 1} stories, "
        f"{len(tokens)} words, {len(vocabulary)} distinct words"
    )


if __name__ == "__main__":
    main()
