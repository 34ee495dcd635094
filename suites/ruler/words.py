"""Built-in text of the ruler suite: the two haystack fillers and the word lists that needle keys and the
common-words task draw from.  All of it is written for kvbench (nothing is downloaded); none of it holds a
digit, so no filler sentence can be mistaken for a needle's number.
"""

from __future__ import annotations

import random

# The "noise" haystack: five short neutral sentences repeated line after line (RULER's noise haystack idea).
NOISE_LINE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

# The "essay" haystack: plain expository prose, repeated when a context needs more of it.
ESSAY = """\
A small town library keeps more than books. On a quiet morning the reading room fills slowly: a student \
with a stack of notes, an older man who reads the newspaper from the first page to the last, a parent \
looking for picture books with a child who would rather look at the fish tank. The librarians know most of \
them by name. They know who likes mysteries and who only reads about gardening, and they set aside the new \
arrivals for the people who will want them first.

The building itself was once a grain store. Its walls are thick, and in summer the rooms stay cool long \
after the street outside has turned hot and dusty. The tall windows were added later, when the town decided \
that a place for reading ought to have good light. Nobody remembers who chose the color of the shelves, but \
everyone agrees it was the right one.

Gardens teach patience in a similar way. Seeds go into the ground in spring, and for weeks there is nothing \
to see but soil. Then the first leaves appear, pale and uncertain, and the gardener begins to worry about \
slugs, about frost, about whether the beans were planted too close together. Most of the work is watching. A \
good gardener learns to notice small changes: a leaf that curls at the edge, a patch of ground that stays \
wet after rain, a row of carrots that grows faster near the fence than in the middle of the bed.

Rivers shape the land around them slowly and without hurry. Over many years a stream will cut a valley, \
carry sand from the hills to the plain, and change its course whenever a flood gives it the chance. People \
have always settled near rivers, for water, for fish and for the easy road that a river offers to anyone \
with a boat. Towns grew where rivers could be crossed, and bridges became the places where markets met.

Weather is the subject that never runs out. Farmers watch the clouds, sailors watch the wind, and everyone \
else watches the sky before deciding whether to carry an umbrella. Forecasts have become much better, yet \
the weather still surprises us. A clear morning turns into an afternoon of heavy rain, or a grey week ends \
with a sudden evening of warm light that makes the whole street look golden.

Cooking at home is a habit that rewards practice more than talent. The first loaf of bread is often dense \
and flat, the second a little better, and by the tenth the cook has learned how the dough should feel and \
how long the oven needs. Recipes help, but they cannot say how ripe the tomatoes are or how strong the \
flour is. Those things are learned by doing, tasting and adjusting, one meal after another.

Walking is perhaps the simplest way to know a place. From a car a town is a series of signs and turns, but \
on foot it becomes a set of details: the bakery that opens before dawn, the cat that sleeps on the same \
wall every afternoon, the old door painted a bright and cheerful blue. A walker notices how streets connect, \
where the shade falls at noon and which corner always smells of coffee.

Music fills the evenings in many homes. Some families sing together, some play old records, and some simply \
leave the radio on while they cook and talk. A tune heard often enough becomes part of a memory, so that \
years later a few notes are enough to bring back a kitchen, a voice or a long drive through the hills.

Libraries, gardens, rivers and kitchens have this in common: they change slowly, they reward attention, \
and they are best understood by the people who spend time in them day after day.
"""

ADJECTIVES = """
able absent active afraid ancient angry anxious aquatic automatic bitter bold brave breezy bright broad
busy calm careful cheerful chilly clean clever cloudy clumsy cold colorful comfortable cool cozy crisp
curious damp dark deep delicate dizzy dry dusty eager early earthy easy elegant empty endless famous fancy
fast fierce flat fluffy foggy fragile fresh friendly frosty funny gentle giant glad golden graceful grand
green happy hard harsh heavy hidden high hollow honest humble hungry icy idle jolly juicy kind large lazy
light little lively lonely long loud lucky magic mellow mighty misty modern narrow neat nervous noisy odd
orange pale patient plain polite proud purple quick quiet rapid rare ready rich rough round royal rusty
sandy scarlet shallow sharp shiny short shy silent silky silver simple sleepy slow smooth soft solid sour
spicy steady sticky stormy strange strong sunny sweet swift tall tame tender thick thin tidy tiny tough
vast velvet violet warm wet wide wild windy wise witty wooden young zealous
""".split()

NOUNS = """
acorn anchor apple apron arrow badge bagel balloon bamboo banana barn basket beach beacon bean bear bell
bench berry bicycle blanket boat bottle boulder bowl branch bread brick bridge brook broom bucket butter
button cabin cactus cake camera camp candle canoe canyon carpet carrot castle cave cello chair chalk cherry
chimney circle cliff clock cloud clover coast coat comet compass cookie copper cottage cotton crayon creek
crown cup curtain daisy desert diamond dolphin door dragon drum eagle easel engine falcon feather fence
fern field fig flag flute forest fountain fox garden garlic gate glacier glove goat grape harbor harp hat
hawk hazel helmet hill honey horizon horse island ivy jacket jar jelly kettle kite ladder lake lamp lantern
leaf lemon lettuce lily lion map maple marble meadow melon mirror mitten moon mountain mug needle nest
night oak oasis ocean olive onion orchard otter owl paddle palace panda paper parrot peach pear pebble
pencil pepper piano pillow pine planet plum pond potato prairie pumpkin puzzle quilt rabbit radio rainbow
raven ribbon river robin rocket rose saddle sail salmon sandal scarf shell ship shovel silk sled snail
sparrow spoon squirrel stable star stone storm stream sugar summit swan table teapot tent thistle thunder
tiger timber tomato torch tower tractor trail tree tulip tunnel turtle umbrella valley vase velvet village
violin wagon walnut whale wheat whistle willow window wolf wool yacht zebra
""".split()

# Common words for the cwe task: nouns and adjectives, one copy each.
COMMON_WORDS = sorted(set(NOUNS) | set(ADJECTIVES))

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def pseudo_words(rng: random.Random, count: int, exclude: frozenset = frozenset()) -> list[str]:
    """``count`` distinct pronounceable made-up words (three consonant-vowel syllables, e.g. ``bakemo``),
    none in ``exclude``; used when a task needs more distinct words than the built-in lists hold."""
    out: list[str] = []
    seen = set(exclude)
    while len(out) < count:
        w = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(3))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out
